"""IP-Adapter references for tests: diffusers' own pipelines (StableDiffusionPipeline, StableDiffusionXLPipeline, and
their Img2Img and Inpaint kinds for a request with an image) with load_ip_adapter and set_ip_adapter_scale, run
alone per request, and the IP-Adapter folders the tests serve."""

from __future__ import annotations

import numpy as np
import torch
from edit_images import start_image

from stepserve import SamplingParams

NAMES = ("face", "style")


def build_ip_adapters(pipe, out, std=0.05):
    """Two tiny random IP-Adapters for the pipeline folder `pipe`, one sub-folder each in `out`."""
    from stepserve.tiny.ipadapter import build_tiny_ip_adapter

    for seed, name in enumerate(NAMES, start=1):
        build_tiny_ip_adapter(pipe, out / name, seed=seed, std=std)
    return out


def request(i, name=None, scale=1.0, guidance=4.0, steps=6, **extra) -> SamplingParams:
    """SD request `i` (16x16, dpmpp_2m) with an image prompt of adapter `name` at `scale` (none when None)."""
    prompt = None if name is None else {"name": name, "image": start_image(50 + i, size=[24, 40][i % 2]),
                                        "scale": scale}
    return SamplingParams(prompt=f"a small cat {i}", seed=800 + i, num_inference_steps=steps,
                          guidance_scale=guidance, sampler="dpmpp_2m", height=16, width=16, ip_adapter=prompt,
                          **extra)


def diffusers_ip_adapter(path, folder, p: SamplingParams, family: str = "sd") -> np.ndarray:
    """uint8 values (as int16) of request `p` by the family's diffusers pipeline (StableDiffusion(XL), its Img2Img
    kind for a request with an image, its Inpaint kind with a mask too) with its IP-Adapter(s) (or none)."""
    import diffusers

    from stepserve.tiny.ipadapter import WEIGHTS

    kind = "" if p.image is None else "Inpaint" if p.mask_image is not None else "Img2Img"
    name = ("StableDiffusionXL{}Pipeline" if family == "sdxl" else "StableDiffusion{}Pipeline").format(kind)
    options = {"add_watermarker": False} if family == "sdxl" else {"safety_checker": None}
    pipe = getattr(diffusers, name).from_pretrained(path, **options)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = diffusers.DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    extra = {} if not kind else {"image": p.image, "strength": p.strength,
                                 **({"mask_image": p.mask_image} if p.mask_image is not None else {})}
    if isinstance(p.ip_adapter, list):  # several adapters: diffusers' lists of adapters, scales and images
        names = [item["name"] for item in p.ip_adapter]
        pipe.load_ip_adapter([str(folder)] * len(names), subfolder=names, weight_name=[WEIGHTS] * len(names))
        pipe.set_ip_adapter_scale([item.get("scale", 1.0) for item in p.ip_adapter])
        extra["ip_adapter_image"] = [item["image"] for item in p.ip_adapter]
    elif p.ip_adapter is not None:
        pipe.load_ip_adapter(str(folder), subfolder=p.ip_adapter["name"], weight_name=WEIGHTS)
        pipe.set_ip_adapter_scale(p.ip_adapter.get("scale", 1.0))
        extra["ip_adapter_image"] = p.ip_adapter["image"]
    image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np", **extra).images[0]
    return (image * 255).round().astype(np.int16)
