"""Runs engine steps on a real pipeline with PyTorch and measures how long each stage took.

One denoising forward covers every request in the step, each at its own timestep. Classifier-free guidance is
per request: a request with guidance_scale > 1 adds an unconditional row; the others pay for one row only.
"""

from __future__ import annotations

import time

import torch

from .. import sampling
from ..pipelines.diffusers_sd import StableDiffusionAdapter
from ..types import Request


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchExecutor:
    def __init__(self, pipeline: StableDiffusionAdapter) -> None:
        self.pipeline = pipeline
        self.model = pipeline.info
        self.device = pipeline.device

    # The engine core only sees these durations; measuring them is the executor's job.
    def _timed(self, fn, *args) -> float:
        _sync(self.device)
        start = time.perf_counter()
        fn(*args)
        _sync(self.device)
        return time.perf_counter() - start

    def prepare(self, requests: list[Request]) -> float:
        return self._timed(self._prepare, requests)

    def denoise(self, requests: list[Request]) -> float:
        return self._timed(self._denoise, requests)

    def decode(self, requests: list[Request]) -> float:
        return self._timed(self._decode, requests)

    # --- stages ------------------------------------------------------------------------------------------------
    def _prepare(self, requests: list[Request]) -> None:
        p = self.pipeline
        prompts = [r.params.prompt for r in requests]
        negatives = [r.params.negative_prompt for r in requests if r.params.guidance_scale > 1]
        embeds = iter(p.encode_prompts(prompts + negatives))
        cond = [next(embeds) for _ in requests]
        for r, c in zip(requests, cond):
            r.prompt_embeds = (c, next(embeds) if r.params.guidance_scale > 1 else None)
            schedule = sampling.build_schedule(r.params.sampler, p.scheduler_config, r.num_steps)
            r.num_steps = schedule.num_steps  # the table's own length (equal to the request for our samplers)
            # Seeds mean what they mean in diffusers: the latents, then any later noise, from one CPU generator.
            generator = torch.Generator("cpu").manual_seed(r.params.seed)
            shape = p.latent_shape(*r.bucket)
            noise = torch.randn(shape, generator=generator, dtype=p.dtype).to(p.device)
            r.latents = noise * sampling.init_noise_sigma(schedule)
            r.sampler_state = sampling.new_state(schedule, generator)

    def _denoise(self, requests: list[Request]) -> None:
        states = [r.sampler_state for r in requests]
        steps = [r.step for r in requests]
        latents = torch.cat([r.latents for r in requests])
        model_in, timesteps = sampling.model_inputs(latents, states, steps)
        guided = [i for i, r in enumerate(requests) if r.params.guidance_scale > 1]
        rows = torch.cat([model_in, model_in[guided]]) if guided else model_in
        t_rows = torch.cat([timesteps, timesteps[guided]]) if guided else timesteps
        embeds = torch.stack([r.prompt_embeds[0] for r in requests] + [requests[i].prompt_embeds[1] for i in guided])
        out = self.pipeline.unet_forward(rows, t_rows.to(rows.device), embeds)
        pred = out[: len(requests)]
        if guided:
            cond = pred[guided]
            uncond = out[len(requests):]
            scale = torch.tensor([requests[i].params.guidance_scale for i in guided], device=out.device,
                                 dtype=out.dtype).view(-1, *([1] * (out.dim() - 1)))
            pred = pred.clone()
            pred[guided] = uncond + scale * (cond - uncond)
        wants = [i for i, r in enumerate(requests) if r.step + 1 in r.preview_steps]
        if wants:  # x0 estimates for preview images, only for the rows that asked for one at this step
            x0 = sampling.predicted_original(pred[wants], latents[wants], [states[i] for i in wants],
                                             [steps[i] for i in wants])
            for j, i in enumerate(wants):
                requests[i].preview_latents = x0[j : j + 1]
        new = sampling.sampler_step(pred, latents, states, steps)
        for i, r in enumerate(requests):
            r.latents = new[i : i + 1]

    def _decode(self, requests: list[Request]) -> None:
        images = self.pipeline.decode(torch.cat([r.latents for r in requests]))
        for r, image in zip(requests, images):
            r.image = image

    def preview(self, request: Request):
        """A preview image: the decoded x0 estimate of the last step if one was kept, else the current latents."""
        latents = request.preview_latents if request.preview_latents is not None else request.latents
        request.preview_latents = None
        return self.pipeline.decode(latents)[0]
