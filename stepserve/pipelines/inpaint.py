"""Inpainting as diffusers' StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline and FluxFillPipeline
do it, one request at a time, so that inpainting rows share forwards with any
other rows:

- "channels" (an inpainting UNet, 9 input channels; Flux Fill): the mask and the masked image's latents are
  concatenated to every row's (scaled) input, in the family's layout (family.inpaint_channels);
- "blend" (an ordinary 4-channel UNet): after every step the known region (mask 0) is replaced by the image's
  latents noised to the next step's level (the clean latents after the last step).

Either way a request starts as diffusers' `prepare_latents` starts it: at strength 1 from pure noise (times the
scheduler's init sigma), below 1 from the image noised to its first step (Flux Fill: always from the image, noised
to its first step's level); the image is encoded first, then the noise drawn, then the masked image encoded, all
from the request's own generator.
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

    extra: Tensor | None = None  # "channels": the denoiser's extra inputs (family.inpaint_channels)
    mask: Tensor | None = None  # "blend": (1, 1, h, w) at latent resolution, 1 repaints, 0 keeps
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


def encodes_image(adapter, strength: float) -> bool:
    """Whether the family's inpaint pipeline encodes the image itself before drawing the noise: to blend it back,
    to start from it (strength below 1), or always (Flux Fill)."""
    return adapter.info.inpaint == "blend" or strength != 1.0 or adapter.inpaint_from_image


@torch.no_grad()
def start(adapter, params, generator: torch.Generator, schedule: sampling.Schedule, step: int,
          image_latents: Tensor | None) -> tuple[Tensor, Inpaint]:
    """(the request's starting latents, its Inpaint state). `image_latents`: the image as the family's inpaint
    pipeline encodes it (`adapter.inpaint_latents`, sampled from the request's generator first) where
    encodes_image says so, else None."""
    noise = None
    if adapter.inpaint_from_image:  # Flux Fill: its img2img start (noise drawn next, mixed at the step's level)
        latents = adapter.start_latents(generator, schedule, step, image_latents)
    else:
        noise = torch.randn(adapter.noise_shape(params.height, params.width), generator=generator,
                            dtype=adapter.dtype).to(adapter.device)
        if params.strength == 1.0:
            latents = noise * sampling.init_noise_sigma(schedule)
        else:
            latents = add_noise(schedule, image_latents, noise, step)
    mask_full = mask_pixels(params, adapter.vae_scale_factor * adapter.image_processor_scale).to(adapter.device)
    if adapter.info.inpaint == "channels":  # the pipelines keep the preprocessed image in float32 until here
        masked = (adapter.image_pixels(params).float() * (mask_full < 0.5)).to(adapter.dtype)
        masked_latents = adapter.inpaint_latents(masked, generator).to(adapter.dtype)
        return latents, Inpaint(extra=adapter.inpaint_channels(mask_full, masked_latents))
    mask = torch.nn.functional.interpolate(mask_full, size=tuple(noise.shape[-2:])).to(adapter.dtype)
    # The pipelines encode the masked image here too, drawing its latent sample from the generator; the draw alone
    # keeps a stochastic sampler's later noise the same (the latents themselves are not used by a 4-channel UNet).
    vae = getattr(adapter.networks, "vae", None)
    torch.randn(noise.shape, generator=generator, dtype=getattr(vae, "dtype", adapter.dtype))
    return latents, Inpaint(mask=mask, image_latents=image_latents, noise=noise, schedule=schedule)


def with_extra_channels(model_in: Tensor, requests) -> Tensor:
    """The step's denoiser input with the inpainting UNet's mask and masked-image channels, when the rows have
    them (every request on such a model is an inpainting request)."""
    extras = [r.inpaint.extra for r in requests if r.inpaint is not None and r.inpaint.extra is not None]
    if not extras:
        return model_in
    # channels: dim 1 of a UNet's (rows, C, h, w); the last of a transformer's packed (rows, tokens, C)
    return torch.cat([model_in, torch.cat(extras).to(model_in)], dim=1 if model_in.dim() == 4 else -1)


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


@torch.no_grad()
def encode_start_images(adapter, params_list, generators) -> list[Tensor | None]:
    """Each request's start image in latent space, for the requests whose pipeline encodes one first (every image
    to image request; an inpainting one where encodes_image says so), else None: one VAE forward per size and
    kind for all of them (img2img and inpaint pipelines may scale differently), each row's sample drawn from its
    own request's generator, as it would be alone."""
    jobs: dict[tuple, list[int]] = {}
    for i, p in enumerate(params_list):
        if p.image is None:
            continue
        masked = p.mask_image is not None
        if masked and not encodes_image(adapter, p.strength):
            continue
        jobs.setdefault((p.height, p.width, masked), []).append(i)
    out: list[Tensor | None] = [None] * len(params_list)
    for (_, _, masked), rows in jobs.items():
        pixels = torch.cat([adapter.image_pixels(params_list[i]) for i in rows])
        encode = adapter.inpaint_latents if masked else adapter.image_latents
        latents = encode(pixels, [generators[i] for i in rows])
        for j, i in enumerate(rows):
            out[i] = latents[j : j + 1]
    return out
