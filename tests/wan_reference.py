"""Wan references for tests: diffusers' own WanPipeline run alone per request, with the diffusers scheduler the
request's stepserve sampler reproduces."""

from __future__ import annotations

import numpy as np
import torch

_PIPES: dict = {}


def wan_pipe(path):
    """(WanPipeline loaded from `path`, its scheduler config as shipped), loaded once per folder."""
    from diffusers import WanPipeline

    if str(path) not in _PIPES:
        pipe = WanPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[str(path)] = (pipe, dict(pipe.scheduler.config))
    return _PIPES[str(path)]


def reference_video(path, p) -> np.ndarray:
    """(frames, H, W, 3) uint8 values (as int16) of request `p` (resolved: sampler, frames and size set)."""
    from stepserve.pipelines.wan import flow_scheduler_config
    from stepserve.sampling import reference_scheduler

    pipe, config = wan_pipe(path)
    pipe.scheduler = reference_scheduler(p.sampler, flow_scheduler_config(config))
    frames = pipe(prompt=p.prompt, negative_prompt=p.negative_prompt or None, height=p.height, width=p.width,
                  num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                  guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                  output_type="np").frames[0]
    return (frames * 255).round().astype(np.int16)
