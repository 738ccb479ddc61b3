"""One request stepped by stepserve.sampling equals diffusers' StableDiffusionPipeline latents for that request,
classifier-free guidance and the ancestral noise draws included."""

from __future__ import annotations

import diffusers
import pytest
import torch
from tiny_sd import SCHEDULER_CLASS, SD_SAMPLERS

import stepserve.sampling as S

CLASSES = {name: SCHEDULER_CLASS[name] for name in SD_SAMPLERS}


@pytest.fixture(scope="module")
def pipe(tiny_sd_path):
    return diffusers.StableDiffusionPipeline.from_pretrained(tiny_sd_path)


@pytest.mark.parametrize("sampler", list(CLASSES))
def test_matches_pipeline_latents(pipe, sampler):
    config, steps, scale, seed, prompt = pipe.scheduler.config, 6, 4.5, 11, "a cat"
    pipe = diffusers.StableDiffusionPipeline(**{**pipe.components, "scheduler": getattr(
        diffusers, CLASSES[sampler]).from_config(config)})
    ref = pipe(prompt, num_inference_steps=steps, guidance_scale=scale, height=16, width=16,
               generator=torch.Generator("cpu").manual_seed(seed), output_type="latent").images

    schedule = S.build_schedule(sampler, config, steps)
    gen = torch.Generator("cpu").manual_seed(seed)
    state = S.new_state(schedule, gen)
    x = torch.randn(tuple(ref.shape), generator=gen) * S.init_noise_sigma(schedule)
    cond, uncond = pipe.encode_prompt(prompt, "cpu", 1, True, None)
    emb = torch.cat([uncond, cond])
    with torch.no_grad():
        for i in range(schedule.num_steps):
            inp, t = S.model_inputs(x, [state], [i])
            out_u, out_c = pipe.unet(torch.cat([inp, inp]), t.repeat(2), encoder_hidden_states=emb).sample.chunk(2)
            x = S.sampler_step(out_u + scale * (out_c - out_u), x, [state], [i])
    assert (x - ref).abs().max().item() <= 1e-5
