"""Batch-size buckets: a padded (and compiled) denoiser gives the rows of an eager one, across bucket boundaries, and
padding rows never reach results or the engine's batch-size statistics."""

from __future__ import annotations

import pytest
import torch

from stepserve.backends.batch_buckets import BatchBucketedNetworks, batch_bucket_for, batch_buckets_up_to, check_batch_buckets, run_batch_bucketed

BATCHES = (1, 2, 3, 4, 5, 8, 9)  # inside, on and across the boundaries of buckets (1, 2, 4, 8); 9 is chunked


class RowWise:
    """A networks object whose rows are independent and exactly computable; records the batch size of each call."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, ...]] = []

    def denoise(self, sample, timestep, encoder_hidden_states, text_embeds=None, img_ids=None):
        self.seen.append((sample.shape[0], timestep.shape[0], encoder_hidden_states.shape[0],
                          -1 if text_embeds is None else text_embeds.shape[0]))
        out = sample * timestep.view(-1, 1, 1, 1) + encoder_hidden_states.sum(dim=(1, 2)).view(-1, 1, 1, 1)
        if text_embeds is not None:
            out = out + text_embeds.sum(dim=1).view(-1, 1, 1, 1)
        if img_ids is not None:  # not batched: the same for every row
            out = out + img_ids.sum()
        return out

    def decode(self, latents):
        return latents * 2


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, 3, 3, generator=g), torch.rand(n, generator=g) * 999,
            torch.randn(n, 5, 6, generator=g), torch.randn(n, 7, generator=g))


def test_bucket_rules():
    assert batch_buckets_up_to(16) == (1, 2, 4, 8, 16)
    assert batch_buckets_up_to(12) == (1, 2, 4, 8, 16)
    assert batch_buckets_up_to(1) == (1,)
    assert [batch_bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 8]
    assert check_batch_buckets([8, 2, 2, 1]) == (1, 2, 8)
    for bad in ([], [0, 2], [1.5], [True]):
        with pytest.raises(ValueError, match="buckets: expected one or more integers >= 1"):
            check_batch_buckets(bad)


@pytest.mark.parametrize("n", BATCHES)
def test_padding_pads_every_batched_kwarg_and_returns_only_real_rows(n):
    inner = RowWise()
    wrapped = BatchBucketedNetworks(inner, (1, 2, 4, 8))
    sample, t, embeds, pooled = _inputs(n)
    ids = torch.ones(n, 3)  # shaped like a batch, but named as unbatched: passed through as is
    out = wrapped.denoise(sample, t, encoder_hidden_states=embeds, text_embeds=pooled, img_ids=ids)
    expected = RowWise().denoise(sample, t, embeds, pooled, ids)
    assert out.shape == expected.shape
    assert torch.equal(out, expected)
    chunks = [min(8, n - s) for s in range(0, n, 8)]
    assert inner.seen == [(batch_bucket_for(c, (1, 2, 4, 8)),) * 4 for c in chunks]
    assert sum(wrapped.calls.values()) == len(chunks)


def test_deterministic_mode_runs_every_network_at_the_fixed_size():
    inner = RowWise()
    wrapped = BatchBucketedNetworks(inner, fixed_rows=6, fixed_other_rows=3)
    for n in (1, 4, 7):
        sample, t, embeds, _ = _inputs(n, seed=n)
        assert torch.equal(wrapped.denoise(sample, t, encoder_hidden_states=embeds), RowWise().denoise(sample, t, embeds))
        assert torch.equal(wrapped.decode(sample), sample * 2)
    assert {s[0] for s in inner.seen} == {6}
    assert wrapped.calls == {6: 4}  # 1 -> one call, 4 -> one call, 7 -> two calls of 6


def test_channels_last_reaches_the_network_after_padding():
    inner = RowWise()
    formats = []

    def denoise(sample, timestep, **kwargs):
        formats.append(sample.is_contiguous(memory_format=torch.channels_last) and not sample.is_contiguous())
        return inner.denoise(sample, timestep, **kwargs)

    wrapped = BatchBucketedNetworks(inner, (4,), denoise_fn=denoise, channels_last=True)
    sample, t, embeds, _ = _inputs(3)
    out = wrapped.denoise(sample, t, encoder_hidden_states=embeds)
    assert formats == [True] and out.is_contiguous()
    assert torch.equal(out, RowWise().denoise(sample, t, embeds))


def test_empty_batch_is_refused_clearly():
    with pytest.raises(ValueError, match="at least one row"):
        run_batch_bucketed(lambda x: x, (1, 2), (torch.zeros(0, 3),), {})


@pytest.fixture(scope="module")
def tiny_networks(tiny_sd_path):
    from stepserve.pipelines.diffusers_sd import StableDiffusionAdapter

    return StableDiffusionAdapter.from_pretrained(tiny_sd_path).networks


@pytest.fixture(scope="module")
def compiled_tiny(tiny_networks):
    """The tiny UNet's denoise traced by torch.compile (aot_eager: the real dynamo/AOT graph per bucket, without
    inductor's code generation, which takes minutes here)."""
    fn = torch.compile(tiny_networks.denoise, backend="aot_eager", dynamic=False)
    return BatchBucketedNetworks(tiny_networks, (1, 4), denoise_fn=fn)  # two graphs keep the compile time low


def test_compiled_buckets_equal_eager_across_boundaries(tiny_networks, compiled_tiny):
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 4, 5, 9):  # 2 and 3 padded to 4; 5 = 4 + 1; 9 = 4 + 4 + 1
        sample = torch.randn(n, 4, 8, 8, generator=g)
        t = torch.randint(0, 1000, (n,), generator=g).float()
        embeds = torch.randn(n, 16, 32, generator=g)
        eager = tiny_networks.denoise(sample, t, encoder_hidden_states=embeds)
        out = compiled_tiny.denoise(sample, t, encoder_hidden_states=embeds)
        assert out.shape == eager.shape == (n, 4, 8, 8)
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-4)
    assert set(compiled_tiny.calls) == {1, 4}


class SmallConvNet(torch.nn.Module):
    """Small enough for inductor to compile in seconds on two cores: conv, group norm, timestep-scaled linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(2, 8)
        self.proj = torch.nn.Linear(6, 8)
        self.out = torch.nn.Conv2d(8, 4, 1)

    @torch.no_grad()
    def denoise(self, sample, timestep, encoder_hidden_states):
        h = self.norm(self.conv(sample)) * torch.cos(timestep / 1000).view(-1, 1, 1, 1)
        h = h + self.proj(encoder_hidden_states).mean(dim=1)[:, :, None, None]
        return self.out(torch.nn.functional.silu(h))


def test_inductor_compiled_buckets_equal_eager():
    net = SmallConvNet().eval()
    wrapped = BatchBucketedNetworks(net, (4,), denoise_fn=torch.compile(net.denoise, dynamic=False))
    g = torch.Generator().manual_seed(5)
    for n in (1, 3, 4, 6):  # one compiled shape: padded to 4, 6 runs as 4 + 2 (padded to 4)
        sample, t, embeds = torch.randn(n, 4, 5, 5, generator=g), torch.rand(n, generator=g) * 999, \
            torch.randn(n, 3, 6, generator=g)
        torch.testing.assert_close(wrapped.denoise(sample, t, encoder_hidden_states=embeds),
                                   net.denoise(sample, t, embeds), atol=1e-5, rtol=1e-4)
    assert wrapped.calls == {4: 5}
