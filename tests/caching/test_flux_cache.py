"""Step caching on Flux: a request alone gives the image diffusers' FluxPipeline gives with the same cache hook
(FirstBlockCacheConfig, MagCacheConfig) on its transformer, skipping the same number of steps; in a mixed batch
(cached and uncached rows, different policies and thresholds) each image is the one it gets alone."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("flux_cache") / "pipe", variant="dev")


@pytest.fixture(scope="module")
def pipe(flux):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(flux)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def engine(flux):
    return Engine.from_pretrained(str(flux), strategy="continuous", max_batch_size=8)


def as_array(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def diffusers_run(pipe, p: SamplingParams, config) -> tuple[np.ndarray, int]:
    """(image, steps that ran the first single block) of FluxPipeline with `config` as its transformer's cache."""
    tr = pipe.transformer
    ran = []
    handle = tr.single_transformer_blocks[0].attn.register_forward_hook(lambda *a: ran.append(1))
    if config is not None:
        tr.enable_cache(config)
    try:
        image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                     guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                     output_type="np").images[0]
    finally:
        handle.remove()
        if config is not None:
            tr.disable_cache()
    return (image * 255).round().astype(np.int16), len(ran)


def fbc(threshold):
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=threshold)


def mag(threshold, steps):
    from diffusers import MagCacheConfig
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    return MagCacheConfig(threshold=threshold, mag_ratios=FLUX_MAG_RATIOS, num_inference_steps=steps)


CASES = [  # (cache field, diffusers config for a request of `steps` steps)
    ({"policy": "fbcache", "threshold": 0.6}, lambda steps: fbc(0.6)),
    ({"policy": "fbcache", "threshold": 2.0}, lambda steps: fbc(2.0)),
    ({"policy": "magcache", "threshold": 0.06}, lambda steps: mag(0.06, steps)),
    ({"policy": "magcache", "threshold": 0.5}, lambda steps: mag(0.5, steps)),
]


def params(i: int, cache, steps: int = 8) -> SamplingParams:
    return SamplingParams(prompt=f"a tiny lighthouse {i}", seed=400 + i, num_inference_steps=steps, height=32,
                          width=32, guidance_scale=3.5, cache=cache)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_alone_equals_diffusers_hook(engine, pipe, case):
    cache, config = CASES[case]
    p = params(case, cache, steps=10)
    want, ran = diffusers_run(pipe, p, config(10))
    got = engine.generate([p])[0]
    assert got.status.value == "completed", got.error
    assert got.timing.cached_steps == 10 - ran  # the same steps skipped as diffusers' hook
    diff = np.abs(as_array(got.image) - want).max()
    assert diff <= 1, f"max pixel difference {diff}"


def test_some_cases_skip_steps(engine):
    """The cases above exercise skipping (a test that never skips would prove nothing)."""
    skipped = [engine.generate([params(i, c, steps=10)])[0].timing.cached_steps for i, (c, _) in enumerate(CASES)]
    assert all(s > 0 for s in skipped), skipped


def test_uncached_is_unchanged(engine, pipe):
    p = params(9, "off", steps=6)
    want, ran = diffusers_run(pipe, p, None)
    got = engine.generate([p])[0]
    assert ran == 6 and got.timing.cached_steps == 0
    assert np.abs(as_array(got.image) - want).max() <= 1


def test_mixed_batch_each_row_decides_for_itself(engine):
    """Cached and uncached rows, two policies and several thresholds, arriving together and at different steps
    counts: each image and its skipped-step count equal the request's own run alone."""
    caches = [None, {"policy": "fbcache", "threshold": 0.6}, {"policy": "magcache", "threshold": 0.5}, "off",
              {"policy": "fbcache", "threshold": 2.0}, {"policy": "magcache", "threshold": 0.06}]
    reqs = [params(20 + i, caches[i % len(caches)], steps=[6, 9, 7, 10][i % 4]) for i in range(10)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1  # they did share forwards
    for a, b in zip(alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(as_array(a.image) - as_array(b.image)).max() <= 1
