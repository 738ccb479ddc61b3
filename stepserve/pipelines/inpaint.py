"""Inpainting for the UNet families (SD 1/2, SDXL) as diffusers' StableDiffusionInpaintPipeline and
StableDiffusionXLInpaintPipeline do it, one request at a time, so that inpainting rows share forwards with any
other rows:

- "channels" (an inpainting UNet, 9 input channels): the mask at latent resolution and the masked image's latents
  are concatenated to every row's (scaled) input;
- "blend" (an ordinary 4-channel UNet): after every step the known region (mask 0) is replaced by the image's
  latents noised to the next step's level (the clean latents after the last step).

Either way a request starts as diffusers' `prepare_latents` starts it: at strength 1 from pure noise (times the
scheduler's init sigma), below 1 from the image noised to its first step; the image is encoded first, then the
noise drawn, then the masked image encoded, all from the request's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import sampling
from ..sampling.img2img import add_noise


@dataclass
class Inpaint:
    """One request's inpainting state (Request.inpaint), kept from admission to the end."""

    mask: Tensor  # (1, 1, h, w) at latent resolution: 1 repaints, 0 keeps
    extra: Tensor | None = None  # "channels": cat([mask, masked image latents], 1), the denoiser's extra inputs
    image_latents: Tensor | None = None  # "blend": the image's clean latents
    noise: Tensor | None = None  # "blend": the starting noise, which noises the known region at every step
    schedule: sampling.Schedule | None = None  # "blend": the request's schedule (the levels add_noise mixes at)


def inpaint_mode(unet_in_channels: int, latent_channels: int) -> str:
    """ModelInfo.inpaint of a UNet: "channels" when it also takes a mask channel and the masked image's latents
    (an inpainting UNet), else "blend"."""
    if unet_in_channels == 2 * latent_channels + 1:
        return "channels"
    if unet_in_channels != latent_channels:
        raise ValueError(f"a UNet with {unet_in_channels} input channels over {latent_channels} latent channels; "
                         f"allowed: {latent_channels} (text to image) or {2 * latent_channels + 1} (inpainting)")
    return "blend"


def mask_pixels(params, vae_scale_factor: int) -> Tensor:
    """The mask as the pipelines' mask processor gives it: grayscale, resized to the request's size, binarised at
    0.5; (1, 1, H, W) float32."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor, do_normalize=False, do_binarize=True,
                                  do_convert_grayscale=True)
    return processor.preprocess(params.mask_image, height=params.height, width=params.width)


@torch.no_grad()
def start(adapter, params, generator: torch.Generator, schedule: sampling.Schedule, step: int
          ) -> tuple[Tensor, Inpaint]:
    """(the request's starting latents, its Inpaint state). `adapter.inpaint_latents(pixels, generator)` encodes
    pixels as the family's inpaint pipeline's `_encode_vae_image` does."""
    mode = adapter.info.inpaint
    pixels = adapter.image_pixels(params).float()  # the pipelines keep the preprocessed image in float32
    strength_max = params.strength == 1.0
    image_latents = None
    if mode == "blend" or not strength_max:
        image_latents = adapter.inpaint_latents(pixels.to(adapter.dtype), generator)
    noise = torch.randn(adapter.noise_shape(params.height, params.width), generator=generator,
                        dtype=adapter.dtype).to(adapter.device)
    if strength_max:
        latents = noise * sampling.init_noise_sigma(schedule)
    else:
        latents = add_noise(schedule, image_latents, noise, step)
    mask_full = mask_pixels(params, adapter.vae_scale_factor).to(adapter.device)
    masked = (pixels * (mask_full < 0.5)).to(adapter.dtype)
    mask = torch.nn.functional.interpolate(mask_full, size=tuple(noise.shape[-2:])).to(adapter.dtype)
    if mode == "channels":
        masked_latents = adapter.inpaint_latents(masked, generator).to(adapter.dtype)
        return latents, Inpaint(mask, extra=torch.cat([mask, masked_latents], dim=1))
    # The pipelines encode the masked image here too, drawing its latent sample from the generator; the draw alone
    # keeps a stochastic sampler's later noise the same (the latents themselves are not used by a 4-channel UNet).
    vae = getattr(adapter.networks, "vae", None)
    torch.randn(noise.shape, generator=generator, dtype=getattr(vae, "dtype", adapter.dtype))
    return latents, Inpaint(mask, image_latents=image_latents, noise=noise, schedule=schedule)


def with_extra_channels(model_in: Tensor, requests) -> Tensor:
    """The step's denoiser input with the inpainting UNet's mask and masked-image channels, when the rows have
    them (every request on such a model is an inpainting request)."""
    extras = [r.inpaint.extra for r in requests if r.inpaint is not None and r.inpaint.extra is not None]
    if not extras:
        return model_in
    return torch.cat([model_in, torch.cat(extras).to(model_in)], dim=1)


def blend(requests, latents: Tensor) -> Tensor:
    """After a sampler step (requests' `step` not yet advanced): each blending request's known region replaced by
    its image latents at the next step's noise level (clean after its last step)."""
    rows = [i for i, r in enumerate(requests) if r.inpaint is not None and r.inpaint.image_latents is not None]
    if not rows:
        return latents
    latents = latents.clone()
    for i in rows:
        r, state = requests[i], requests[i].inpaint
        nxt = r.step + 1
        known = state.image_latents
        if nxt < r.num_inference_steps:
            known = add_noise(state.schedule, known, state.noise, nxt)
        latents[i : i + 1] = (1 - state.mask) * known + state.mask * latents[i : i + 1]
    return latents
