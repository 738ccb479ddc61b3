"""diffusers' own pipeline for one request, alone: the oracle of the tests that serve several families at once."""

import numpy as np
import torch
from tiny_sd import SCHEDULER_CLASS

from stepserve import SamplingParams

PIPELINES = {"sd": "StableDiffusionPipeline", "flux": "FluxPipeline"}


def reference_image(family: str, path, p: SamplingParams) -> np.ndarray:
    """The image diffusers makes for `p` with the same seed (uint8 values as int16, for differences)."""
    import diffusers

    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(
        path, **({"safety_checker": None} if family == "sd" else {}))
    pipe.set_progress_bar_config(disable=True)
    extra = {}
    if family == "sd":
        pipe.scheduler = getattr(diffusers, SCHEDULER_CLASS[p.sampler]).from_config(pipe.scheduler.config)
        extra["negative_prompt"] = p.negative_prompt or None
    image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np", **extra).images[0]
    return (image * 255).round().astype(np.int16)


def fill_reference(path, p: SamplingParams) -> np.ndarray:
    """diffusers' FluxFillPipeline for one inpainting request at 32x32 (its image, mask and strength)."""
    import diffusers

    pipe = diffusers.FluxFillPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    options = {} if p.strength is None else {"strength": p.strength}
    image = pipe(p.prompt, image=p.image, mask_image=p.mask_image, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale if p.guidance_scale is not None else 30.0, height=32, width=32,
                 generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np", **options).images[0]
    return (image * 255).round().astype(np.int16)
