"""--dtype float16|bfloat16 end to end: the networks run in half precision, the samplers' arithmetic stays float32
(a half-precision latent is upcast before any update, as diffusers' schedulers upcast), and images stay close to
float32's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams, sampling

SD_SAMPLERS = ("ddim", "euler", "euler_a", "dpmpp_2m")


@pytest.mark.parametrize("sampler", SD_SAMPLERS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sampler_arithmetic_is_float32_for_half_latents(sampler, dtype):
    import json

    from stepserve.pipelines.diffusers_sd import EMBEDDED_PATH

    config = json.loads((EMBEDDED_PATH / "scheduler" / "scheduler_config.json").read_text())
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 4, 8, 8, generator=g).to(dtype)
    pred = torch.randn(3, 4, 8, 8, generator=g).to(dtype)

    def run(x, out):
        states = [sampling.new_state(sampling.build_schedule(sampler, config, 10), torch.Generator().manual_seed(k))
                  for k in range(3)]
        return sampling.sampler_step(out, x, states, [0, 3, 7] if sampler != "dpmpp_2m" else [0, 0, 0])

    half = run(latents, pred)
    # the same values with the latents given in float32 (the prediction stays in the model's dtype: euler_a draws
    # its noise in that dtype, as diffusers does)
    upcast = run(latents.float(), pred)
    assert half.dtype == dtype
    assert torch.equal(half, upcast.to(dtype))


@pytest.fixture(scope="module")
def float32_images():
    engine = Engine.from_pretrained("embedded", memory_cap=False)
    return engine, [np.asarray(r.image, dtype=np.int16) for r in engine.generate(PARAMS)]


PARAMS = [SamplingParams(prompt="seven", seed=3, num_inference_steps=8, sampler=s) for s in SD_SAMPLERS]


@pytest.mark.parametrize("dtype,limit", [("float16", 3), ("bfloat16", 16)])
def test_half_precision_engine_images_stay_close_to_float32(float32_images, dtype, limit):
    _, reference = float32_images
    engine = Engine.from_pretrained("embedded", dtype=dtype, memory_cap=False)
    unet = engine.executor.pipeline.networks.unet
    assert next(unet.parameters()).dtype == getattr(torch, dtype)
    results = engine.generate(PARAMS)
    assert all(r.ok for r in results)
    for r, ref in zip(results, reference):
        diff = np.abs(np.asarray(r.image, dtype=np.int16) - ref)
        assert diff.max() <= limit and diff.mean() < limit / 4, (r.params.sampler, diff.max(), diff.mean())
