"""The pieces of sequence parallelism that run on one process: fbcache's decision over split residuals (the sums over
the ranks give the whole row's ratio, so every rank decides as one process does), the caching forwards taking
their decision on the reduced values, and Qwen-Image's text padded to a multiple of the degree (with its mask)
giving diffusers' own image."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.caching.rows import RowCache, must_compute
from stepserve.caching.spec import CacheSpec


def _row(ref: torch.Tensor, threshold: float) -> RowCache:
    return RowCache(CacheSpec("fbcache", threshold=threshold), {"ref": ref, "tail": torch.zeros_like(ref)}, step=3)


def test_fbcache_decides_on_the_whole_residual_from_its_shards():
    """One row's residual split in two token halves, one barely moved, the other much: each half alone decides
    otherwise than the whole row, and with the sums over both halves each rank decides as the whole row."""
    torch.manual_seed(0)
    ref = torch.randn(1, 8, 4)
    now = ref.clone()
    now[:, 4:] += 0.5 * torch.randn(1, 4, 4)  # the second half's tokens moved
    halves = [(now[:, :4], ref[:, :4]), (now[:, 4:], ref[:, 4:])]
    whole = (now - ref).abs().mean() / ref.abs().mean()
    threshold = float(whole) * 0.999  # the whole row just computes
    assert must_compute([_row(ref, threshold)], now, "tail") == [True]
    alone = [must_compute([_row(r, threshold)], s, "tail")[0] for s, r in halves]
    assert alone == [False, True]  # the ranks would disagree (and then wait for each other forever)

    def means(s, r):
        return torch.stack([(s - r).abs().mean(), r.abs().mean()])[None]

    both = means(*halves[0]) + means(*halves[1])
    for s, r in halves:
        assert must_compute([_row(r, threshold)], s, "tail", over_ranks=lambda x: both) == [True]
    assert must_compute([_row(ref, float(whole) * 1.001)], now, "tail") == [False]
    for s, r in halves:  # just above: every rank skips, as the whole row does
        assert must_compute([_row(r, float(whole) * 1.001)], s, "tail", over_ranks=lambda x: both) == [False]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux

    path = build_tiny_flux(tmp_path_factory.mktemp("flux_pieces") / "pipe", variant="dev")
    return Engine.from_pretrained(str(path), strategy="continuous", memory_cap=False, max_batch_size=4)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from stepserve.tiny.qwenimage import build_tiny_qwenimage

    path = build_tiny_qwenimage(tmp_path_factory.mktemp("qwen_pieces") / "pipe")
    return path, Engine.from_pretrained(str(path), strategy="continuous", memory_cap=False, max_batch_size=4)


def _loud_other_rank(x: torch.Tensor) -> torch.Tensor:
    """What the sums over the ranks give when another rank's shard moved a lot: the residual's change, large."""
    return x + torch.stack([100 * x[:, 1], torch.zeros_like(x[:, 1])], dim=1)


@pytest.mark.parametrize("family", ["flux", "qwen"])
def test_the_caching_forwards_decide_on_the_sums_over_the_ranks(family, flux, qwen, monkeypatch):
    """A row that skips steps alone computes every step when the sums over the ranks say the residual moved."""
    import importlib

    engine = flux if family == "flux" else qwen[1]
    p = SamplingParams(prompt="a tiny lighthouse", seed=4, num_inference_steps=8, height=32, width=32,
                       cache={"policy": "fbcache", "threshold": 2.0})
    assert engine.generate([p])[0].timing.cached_steps > 0
    module = importlib.import_module(f"stepserve.caching.{'flux' if family == 'flux' else 'qwenimage'}")
    monkeypatch.setattr(module, "sum_over_ranks", lambda x, tr: _loud_other_rank(x))
    assert engine.generate([p])[0].timing.cached_steps == 0


def test_qwen_text_padded_to_the_degree_gives_diffusers_image(qwen, monkeypatch):
    """At a sequence degree of 2 a step's text is padded to an even length, with the mask (one row of an odd
    length too, which alone passes no mask): the images stay diffusers' own."""
    import stepserve.pipelines.qwenimage as qwenimage

    path, engine = qwen
    pipeline = engine.executor.pipeline
    rows = [c.cond for c in pipeline.encode([SamplingParams(prompt=t, height=32, width=32, num_inference_steps=2,
                                                            seed=0, sampler="flow_euler", guidance_scale=1.0)
                                             for t in ("a", "a much longer prompt")])]
    lengths = [r["encoder_hidden_states"].shape[1] for r in rows]
    odd = next(r for r, n in zip(rows, lengths) if n % 2)
    assert "encoder_hidden_states_mask" not in pipeline.collate([odd])
    monkeypatch.setattr(qwenimage, "sequence_degree", lambda transformer: 2)
    alone = pipeline.collate([odd])
    assert alone["encoder_hidden_states"].shape[1] % 2 == 0 and alone["encoder_hidden_states_mask"].sum() == \
        odd["encoder_hidden_states"].shape[1]
    both = pipeline.collate(rows)
    assert both["encoder_hidden_states"].shape[1] == -(-max(lengths) // 2) * 2
    assert both["encoder_hidden_states_mask"].sum(dim=1).tolist() == lengths

    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    params = [SamplingParams(prompt=t, negative_prompt=n, seed=7 + i, num_inference_steps=3, guidance_scale=4.0,
                             height=32, width=32) for i, (t, n) in enumerate([("seven", "blurry"), ("a fox", "")])]
    for r, p in zip(engine.generate(params), params):
        want = pipe(p.prompt, negative_prompt=p.negative_prompt or None, true_cfg_scale=p.guidance_scale,
                    height=32, width=32, num_inference_steps=3, generator=torch.Generator("cpu").manual_seed(p.seed),
                    output_type="np").images[0]
        got = np.asarray(r.image.convert("RGB"), dtype=np.int16)
        assert np.abs(got - (want * 255).round().astype(np.int16)).max() <= 1
