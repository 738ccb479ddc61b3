"""LoRA references for tests: diffusers' own pipeline with the adapters loaded by `load_lora_weights` and weighted
by `set_adapters`, run alone per request."""

from __future__ import annotations

import numpy as np
import torch


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def diffusers_sd(path, files, p, loras) -> np.ndarray:
    """uint8 values (as int16) of SD request `p` (prompt, seed, steps, guidance; 16x16, dpmpp_2m) with `loras`:
    (name, scale) pairs, each name's file in `files`."""
    import diffusers

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(path, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = diffusers.DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    for name, _ in loras:
        pipe.load_lora_weights(str(files[name]), adapter_name=name)
    if loras:
        pipe.set_adapters([n for n, _ in loras], [s for _, s in loras])
    image = pipe(p.prompt, height=16, width=16, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)
