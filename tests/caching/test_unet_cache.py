"""Step caching on UNets (the embedded model; SDXL's tiny UNet for added conditioning): the split forward equals
the UNet's own when every row computes, its shallow path equals the full forward on the same step's deep
features, deepcache skips exactly the steps its interval says, and a row's decisions and image do not depend on
who shares its batch. Bad cache fields fail the request alone with a message naming what is allowed."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.caching.rows import RowCache
from stepserve.caching.unet import unet_forward
from stepserve.request.types import CacheSpec

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained("embedded", strategy="continuous", max_batch_size=8)


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def params(i: int, cache, steps: int = 12, guidance: float | None = None) -> SamplingParams:
    return SamplingParams(prompt=f"a photo of the digit {i % 10}", seed=70 + i, num_inference_steps=steps,
                          guidance_scale=guidance, cache=cache)


def inputs(unet, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = unet.config
    x = torch.randn(n, c.in_channels, c.sample_size, c.sample_size, generator=g)
    t = torch.tensor([900.0, 500.0, 20.0][:n])
    e = torch.randn(n, 16, c.cross_attention_dim, generator=g)
    return x, t, e


def test_every_row_computing_is_the_unets_own_forward(engine):
    unet = engine.executor.pipeline.unet
    x, t, e = inputs(unet)
    rows = [None, RowCache(CacheSpec("fbcache", threshold=0.1), {}, 0), RowCache(CacheSpec("deepcache", interval=3), {}, 0)]
    want = unet(x, t, encoder_hidden_states=e, return_dict=False)[0]
    assert torch.equal(unet_forward(unet, x, t, e, rows), want)
    assert all(r is None or (not r.skipped and "deep" in r.tensors) for r in rows)


def test_shallow_path_on_the_same_steps_deep_features_is_the_full_forward(engine):
    unet = engine.executor.pipeline.unet
    x, t, e = inputs(unet)
    want = unet(x, t, encoder_hidden_states=e, return_dict=False)[0]
    first = [RowCache(CacheSpec("deepcache", interval=4), {}, 0) for _ in range(3)]
    unet_forward(unet, x, t, e, first)  # step 0 computes and caches
    again = [RowCache(CacheSpec("deepcache", interval=4), r.tensors, 1) for r in first]  # step 1 reuses
    got = unet_forward(unet, x, t, e, again)
    assert all(r.skipped for r in again)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_deepcache_interval_one_is_uncached(engine):
    plain = engine.generate([params(1, None)])[0]
    every = engine.generate([params(1, {"policy": "deepcache", "interval": 1})])[0]
    assert every.timing.cached_steps == 0
    assert np.array_equal(pixels(plain.image), pixels(every.image))


@pytest.mark.parametrize("interval,steps", [(2, 12), (3, 12), (5, 7)])
def test_deepcache_skips_what_its_interval_says(engine, interval, steps):
    got = engine.generate([params(2, {"policy": "deepcache", "interval": interval}, steps=steps)])[0]
    assert got.timing.cached_steps == steps - len(range(0, steps, interval))


def test_fbcache_threshold_zero_never_skips_and_large_always_reuses(engine):
    zero = engine.generate([params(3, {"policy": "fbcache", "threshold": 0.0})])[0]
    big = engine.generate([params(3, {"policy": "fbcache", "threshold": 10.0})])[0]
    plain = engine.generate([params(3, "off")])[0]
    assert zero.timing.cached_steps == 0 and np.array_equal(pixels(zero.image), pixels(plain.image))
    assert big.timing.cached_steps == 11  # every step after the first reuses its deep features


def test_mixed_batch_each_row_decides_for_itself(engine):
    caches = [None, {"policy": "fbcache", "threshold": 0.15}, {"policy": "deepcache", "interval": 3}, "off",
              {"policy": "fbcache", "threshold": 0.5}, {"policy": "deepcache", "interval": 2}]
    reqs = [params(10 + i, caches[i % len(caches)], steps=[8, 15, 11][i % 3], guidance=[1.0, 3.0][i % 2])
            for i in range(12)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    assert any(r.timing.cached_steps for r in together)
    for a, b in zip(alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_cache_state_is_freed_when_the_request_ends(engine, monkeypatch):
    seen, sizes = [], []
    denoise = engine.executor.denoise

    def spy(requests):
        seen.extend(requests)
        sizes.append(sum(r.step_cache.nbytes() for r in requests if r.step_cache is not None))
        return denoise(requests)

    monkeypatch.setattr(engine.executor, "denoise", spy)
    engine.generate([params(4, {"policy": "deepcache", "interval": 2})])
    assert max(sizes) > 0  # it held cached features while it ran
    assert seen and all(r.step_cache is None for r in seen)  # and dropped them at the end


@pytest.mark.parametrize("cache,words", [
    ("teacache", "allowed: fbcache, deepcache, magcache"),
    ("magcache", "allowed here: fbcache, deepcache"),
    ({"policy": "fbcache", "threshold": -1}, "threshold must be a number in [0, 10]"),
    ({"policy": "deepcache", "interval": 0}, "interval must be an integer in [1, 50]"),
    ({"policy": "deepcache", "interval": float("inf")}, "interval must be an integer in [1, 50]"),
    ({"policy": "fbcache", "threshold": float("nan")}, "threshold must be a number in [0, 10]"),
    ({"policy": "deepcache", "every": 2}, "unknown: every"),
    (12, "expected 'off', a policy name"),
])
def test_bad_cache_fields_name_what_is_allowed(engine, cache, words):
    with pytest.raises(ValidationError) as err:
        engine.generate([params(5, cache)])
    assert err.value.field == "cache" and words in str(err.value)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    from stepserve.tiny.sdxl import build_tiny_sdxl

    path = build_tiny_sdxl(tmp_path_factory.mktemp("sdxl_cache") / "pipe")
    return Engine.from_pretrained(str(path), strategy="continuous", max_batch_size=8)


def test_sdxl_added_conditioning_every_row_computing_is_the_unets_own_forward(sdxl):
    unet = sdxl.executor.pipeline.networks.unet
    x, t, e = inputs(unet)
    g = torch.Generator().manual_seed(1)
    added = {"text_embeds": torch.randn(3, 32, generator=g),
             "time_ids": torch.tensor([[16.0, 16, 0, 0, 16, 16]] * 3)}
    want = unet(x, t, encoder_hidden_states=e, added_cond_kwargs=added, return_dict=False)[0]
    rows = [RowCache(CacheSpec("deepcache", interval=2), {}, 0), None, RowCache(CacheSpec("fbcache", threshold=0.2), {}, 0)]
    assert torch.equal(unet_forward(unet, x, t, e, rows, added_cond_kwargs=added), want)


def test_sdxl_mixed_batch_each_row_decides_for_itself(sdxl):
    caches = [{"policy": "deepcache", "interval": 2}, None, {"policy": "fbcache", "threshold": 0.3}, "off"]
    reqs = [SamplingParams(prompt=f"a small red cube {i}", seed=90 + i, num_inference_steps=[6, 9][i % 2],
                           cache=caches[i % len(caches)]) for i in range(8)]
    alone = [sdxl.generate([p])[0] for p in reqs]
    together = sdxl.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    assert any(r.timing.cached_steps for r in together)
    for a, b in zip(alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
