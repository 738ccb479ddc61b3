"""ControlNet references for tests: diffusers' own ControlNet pipelines (StableDiffusionControlNetPipeline,
StableDiffusionXLControlNetPipeline, StableDiffusion3ControlNetPipeline, FluxControlNetPipeline,
QwenImageControlNetPipeline, and the SD, SDXL and Flux.1 Img2Img and Inpaint kinds for a request with an image;
their Multi models for several ControlNets) run alone per request, and the ControlNet folders the tests serve."""

from __future__ import annotations

import numpy as np
import torch
from edit_images import start_image

from stepserve import SamplingParams

NAMES = ("pose", "depth", "edge")
PIPELINES = {"sd": "StableDiffusionControlNetPipeline", "sdxl": "StableDiffusionXLControlNetPipeline",
             "flux": "FluxControlNetPipeline"}
EDIT_PIPELINES = {"sd": "StableDiffusionControlNet{}Pipeline", "sdxl": "StableDiffusionXLControlNet{}Pipeline",
                  "flux": "FluxControlNet{}Pipeline"}
MMDIT = {"flux": ("FluxControlNetPipeline", "FluxControlNetModel", "FluxMultiControlNetModel"),
         "sd3": ("StableDiffusion3ControlNetPipeline", "SD3ControlNetModel", "SD3MultiControlNetModel"),
         "qwenimage": ("QwenImageControlNetPipeline", "QwenImageControlNetModel", "QwenImageMultiControlNetModel")}
WEIGHTS = "diffusion_pytorch_model.safetensors"


def build_controlnets(pipe, out):
    """Three tiny random ControlNets of the pipeline folder `pipe`, one sub-folder each in `out`."""
    from stepserve.tiny.controlnet import build_tiny_controlnet

    for seed, name in enumerate(NAMES, start=1):
        build_tiny_controlnet(pipe, out / name, seed=seed, std=0.05)
    return out


def request(i, controls=(), guidance=4.0, steps=6, sampler="dpmpp_2m", guess=None, **extra) -> SamplingParams:
    """Request `i` (16x16) with `controls`: (name, scale, start, end) each, with an image of its own (and
    "guess_mode": `guess` in each unless None)."""
    return SamplingParams(prompt=f"a small cat {i}", seed=700 + i, num_inference_steps=steps,
                          guidance_scale=guidance, sampler=sampler, height=16, width=16,
                          controls=[{"name": n, "image": start_image(10 * i + k, size=[16, 24][k % 2]), "scale": s,
                                     "start": a, "end": b, **({} if guess is None else {"guess_mode": guess})}
                                    for k, (n, s, a, b) in enumerate(controls)], **extra)


def diffusers_controlnet(path, folder, p: SamplingParams, family: str = "sd") -> np.ndarray:
    """uint8 values (as int16) of request `p` by the family's diffusers ControlNet pipeline with its ControlNets."""
    import diffusers

    several = len(p.controls) > 1
    kind = "" if p.image is None else "Inpaint" if p.mask_image is not None else "Img2Img"
    name = EDIT_PIPELINES[family].format(kind) if kind else PIPELINES.get(family)
    if family in MMDIT:
        pipeline, model, multi = (getattr(diffusers, n) for n in MMDIT[family])
        pipeline = getattr(diffusers, name) if kind else pipeline
        nets = [model.from_pretrained(folder / c["name"]) for c in p.controls]
        if family == "qwenimage" and several:  # its multi model runs one ControlNet on several images
            assert len({(folder / c["name"] / WEIGHTS).read_bytes() for c in p.controls}) == 1
            nets = nets[:1]
        pipe = pipeline.from_pretrained(path, controlnet=multi(nets) if several else nets[0])
    else:
        nets = [diffusers.ControlNetModel.from_pretrained(folder / c["name"]) for c in p.controls]
        extra = {"add_watermarker": False} if family == "sdxl" else {"safety_checker": None}
        pipe = getattr(diffusers, name).from_pretrained(path, controlnet=nets if several else nets[0], **extra)
        pipe.scheduler = diffusers.DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    guess = {} if family in MMDIT else {"guess_mode": any(c.get("guess_mode") for c in p.controls)}

    def each(key):
        values = [c[key] for c in p.controls]
        return values if several else values[0]

    edit = {} if not kind else {"image": p.image, "strength": p.strength, "control_image": each("image"),
                                **({"mask_image": p.mask_image} if p.mask_image is not None else {})}
    if kind and family == "flux" and several:  # its Multi model zips the images with one mode each (None: no mode)
        edit["control_mode"] = [None] * len(p.controls)
    torch.manual_seed(p.seed)  # SD3's pipeline samples the control image's latents from torch's global generator
    image = pipe(p.prompt, **(edit or {"control_image" if family in MMDIT else "image": each("image")}),
                 height=p.height, width=p.width,
                 num_inference_steps=p.num_inference_steps,
                 **({"true_cfg_scale": p.guidance_scale, "negative_prompt": p.negative_prompt or None}
                    if family == "qwenimage" else {"guidance_scale": p.guidance_scale}),
                 controlnet_conditioning_scale=each("scale"), control_guidance_start=each("start"),
                 control_guidance_end=each("end"), generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np", **guess).images[0]
    return (image * 255).round().astype(np.int16)
