"""First-Block Cache on Qwen-Image: a request alone gives the image diffusers' QwenImagePipeline gives with
FirstBlockCacheConfig on its transformer, skipping the same steps (with true CFG too: one cache state per branch);
in a mixed batch (cached and uncached rows, thresholds, prompt lengths, guidance) each image is the one it gets
alone; magcache is refused on this family."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams, ValidationError

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from stepserve.tiny.qwenimage import build_tiny_qwenimage

    return build_tiny_qwenimage(tmp_path_factory.mktemp("qwen_cache") / "pipe")


@pytest.fixture(scope="module")
def pipe(qwen):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def engine(qwen):
    return Engine.from_pretrained(str(qwen), strategy="continuous", max_batch_size=8)


def as_array(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def diffusers_run(pipe, p: SamplingParams, threshold: float | None) -> tuple[np.ndarray, int]:
    """(image, forwards that ran the second block's attention) of QwenImagePipeline with First-Block Cache at `threshold`."""
    from diffusers import FirstBlockCacheConfig

    tr = pipe.transformer
    ran = []
    handle = tr.transformer_blocks[1].attn.register_forward_hook(lambda *a: ran.append(1))  # skipped: not run
    if threshold is not None:
        tr.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        image = pipe(p.prompt, negative_prompt=p.negative_prompt or None, true_cfg_scale=p.guidance_scale,
                     height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                     generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np").images[0]
    finally:
        handle.remove()
        if threshold is not None:
            tr.disable_cache()
    return (image * 255).round().astype(np.int16), len(ran)


def params(i: int, cache, steps: int = 10, negative: str = "") -> SamplingParams:
    return SamplingParams(prompt=f"a tiny lighthouse {'at dusk ' * (i % 3)}{i}", negative_prompt=negative,
                          seed=400 + i, num_inference_steps=steps, height=32, width=32, guidance_scale=4.0,
                          cache=cache)


@pytest.mark.parametrize("threshold", [0.9, 2.0])
def test_alone_equals_diffusers_hook(engine, pipe, threshold):
    p = params(1, {"policy": "fbcache", "threshold": threshold})
    want, ran = diffusers_run(pipe, p, threshold)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert 0 < got.timing.cached_steps == 10 - ran  # skips, the same ones as diffusers' hook
    assert np.abs(as_array(got.image) - want).max() <= 1


def test_alone_with_true_cfg_equals_diffusers_hook(engine, pipe):
    p = params(2, {"policy": "fbcache", "threshold": 2.0}, negative="blurry")
    want, ran = diffusers_run(pipe, p, 2.0)
    got = engine.generate([p])[0]
    assert got.ok and got.timing.cached_steps > 0
    assert ran < 20  # both branches skipped some steps in diffusers too
    assert np.abs(as_array(got.image) - want).max() <= 1


def test_uncached_is_unchanged(engine, pipe):
    p = params(3, "off", steps=6)
    want, ran = diffusers_run(pipe, p, None)
    got = engine.generate([p])[0]
    assert ran == 6 and got.timing.cached_steps == 0
    assert np.abs(as_array(got.image) - want).max() <= 1


def test_mixed_batch_each_row_decides_for_itself(engine):
    caches = [None, {"policy": "fbcache", "threshold": 0.9}, "off", {"policy": "fbcache", "threshold": 2.0}]
    reqs = [params(20 + i, caches[i % 4], steps=[6, 9, 7, 10][i % 4], negative=["", "blurry"][(i // 2) % 2])
            for i in range(8)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    assert sum(r.timing.cached_steps for r in together) > 0
    for a, b in zip(alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(as_array(a.image) - as_array(b.image)).max() <= 1


def test_magcache_is_refused_here(engine):
    with pytest.raises(ValidationError, match="cache.*fbcache"):
        engine.generate([params(5, {"policy": "magcache", "threshold": 0.1})])
