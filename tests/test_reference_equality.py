"""Served images equal diffusers' own StableDiffusionPipeline, under every strategy and any batch company."""

import numpy as np
import pytest

from stepserve import Engine, SamplingParams
from stepserve.scheduling import STRATEGIES
from tiny_sd import SD_SAMPLERS as SAMPLERS
from tiny_sd import reference_image

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


def mixed_requests(n=12):
    out = []
    for i in range(n):
        out.append(SamplingParams(
            prompt=["a cat", "seven", "the digit 3", "zz top", "blue sky"][i % 5] + f" {i}",
            negative_prompt="blurry" if i % 4 == 3 else "",
            seed=1000 + 17 * i,
            num_inference_steps=[3, 7, 12, 5][i % 4],
            guidance_scale=[1.0, 4.5, 7.5][i % 3],
            sampler=SAMPLERS[i % len(SAMPLERS)],
            height=16, width=16,
        ))
    return out


@pytest.fixture(scope="module")
def references(tiny_sd_path):
    return [reference_image(tiny_sd_path, p) for p in mixed_requests()]


def as_array(image):
    return np.asarray(image.convert("RGB"), dtype=np.int16)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_diffusers_image(tiny_sd_path, references, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    results = engine.generate(mixed_requests())
    assert all(r.ok for r in results), [r.error for r in results]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, ref in zip(results, references):
        diff = np.abs(as_array(r.image) - ref.astype(np.int16))
        assert diff.max() <= 1, (r.params, diff.max())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_invariance(tiny_sd_path, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    target = SamplingParams(prompt="seven", seed=5, num_inference_steps=9, guidance_scale=5.0, sampler="euler_a",
                            height=16, width=16)
    alone = engine.generate([target])[0]
    crowd = mixed_requests(7)
    amid = engine.generate(crowd[:3] + [target] + crowd[3:])[3]
    assert max(amid.timing.batch_sizes) > 1 or strategy == "none"
    diff = np.abs(as_array(alone.image) - as_array(amid.image))
    assert diff.max() <= 1 and diff.mean() < 0.01


def test_v_prediction_model_matches_diffusers(tiny_sd_vpred_path):
    engine = Engine.from_pretrained(str(tiny_sd_vpred_path), strategy="continuous", max_batch_size=4)
    reqs = [SamplingParams(prompt=f"v {i}", seed=i, num_inference_steps=4 + i, guidance_scale=3.0,
                           sampler=SAMPLERS[i % 4], height=16, width=16) for i in range(4)]
    results = engine.generate(reqs)
    for r, p in zip(results, reqs):
        diff = np.abs(as_array(r.image) - reference_image(tiny_sd_vpred_path, p).astype(np.int16))
        assert diff.max() <= 1, (p, diff.max())


def _diffusers_x0_estimates(path, params) -> list:
    """The x0 estimate diffusers' own pipeline computes at each step (dpmpp_2m: its convert_model_output), and the
    final image, for one request."""
    import diffusers
    import torch

    from tiny_sd import _load

    pipe = _load(path)
    sched = diffusers.DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    estimates = []
    convert = sched.convert_model_output

    def recording(*args, **kwargs):
        out = convert(*args, **kwargs)
        estimates.append(out.clone())
        return out

    sched.convert_model_output = recording
    original, pipe.scheduler = pipe.scheduler, sched
    try:
        pipe(params.prompt, height=params.height, width=params.width, num_inference_steps=params.num_inference_steps,
             guidance_scale=params.guidance_scale, generator=torch.Generator("cpu").manual_seed(params.seed))
    finally:
        pipe.scheduler = original
    assert len(estimates) == params.num_inference_steps
    return estimates


def test_previews_are_x0_estimates_and_do_not_change_the_image(tiny_sd_path):
    from stepserve.engine.loading import load_executor
    from stepserve.engine.core import EngineCore
    from stepserve.scheduling import make_policy

    ex = load_executor(str(tiny_sd_path))
    p = SamplingParams(prompt="seven", seed=3, num_inference_steps=6, guidance_scale=4.0, sampler="dpmpp_2m",
                       height=16, width=16)
    core = EngineCore(ex, make_policy("continuous", 2))
    r = core.add_request(p, 0.0, preview_steps=frozenset({2, 4}))
    previews, noisy = {}, {}
    t = 0.0
    while not r.is_finished:
        core.step(t)
        t += 1
        if r.step in r.preview_steps and not r.is_finished:
            assert r.preview_latents is not None
            noisy[r.step] = ex.pipeline.decode(r.latents)[0]  # what a preview of the raw latents would show
            previews[r.step] = ex.preview(r)
        else:
            assert r.preview_latents is None or r.is_finished
    assert sorted(previews) == [2, 4] and previews[2].size == (16, 16)
    final = as_array(r.image)
    diff = np.abs(final - reference_image(tiny_sd_path, p).astype(np.int16))
    assert diff.max() <= 1

    # The preview after step k is the decoded x0 estimate of step k (index k - 1): what diffusers estimates there.
    estimates = _diffusers_x0_estimates(tiny_sd_path, p)
    for k, preview in previews.items():
        want = as_array(ex.pipeline.decode(estimates[k - 1].to(ex.pipeline.dtype))[0])
        assert np.abs(as_array(preview) - want).max() <= 1, k
        # and it is not a decode of the raw noisy latents: it is much closer to the final image than that decode
        to_final = np.abs(as_array(preview) - final).mean()
        noisy_to_final = np.abs(as_array(noisy[k]) - final).mean()
        assert to_final < 0.5 * noisy_to_final, (k, to_final, noisy_to_final)
