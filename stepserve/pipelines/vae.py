"""What the UNet/VAE families share about their VAE: its downscale, the dtype to keep it in, decoding as diffusers'
pipelines do, and images as diffusers' image processor rounds them."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import Tensor


def vae_scale_factor_of(vae_config) -> int:
    """How much the VAE downscales height and width: 2 per down block after the first."""
    return 2 ** (len(vae_config.block_out_channels) - 1)


def vae_dtype(vae_config, dtype: torch.dtype) -> torch.dtype:
    """The dtype to keep the VAE in: float32 when a float16 pipeline's VAE says `force_upcast` (diffusers' SDXL
    pipeline upcasts such a VAE for every decode because it overflows in float16), else the pipeline's dtype."""
    return torch.float32 if dtype == torch.float16 and getattr(vae_config, "force_upcast", False) else dtype


def vae_decode(vae, latents: Tensor) -> Tensor:
    """Latents -> images in [-1, 1] as diffusers' SD/SDXL pipelines decode them: with the VAE's latents_mean/std
    when its config has both, else divided by scaling_factor; decoded in the VAE's own dtype (see vae_dtype)."""
    cfg = vae.config
    mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
    if mean is not None and std is not None:
        view = (1, len(mean), 1, 1)
        latents = (latents * torch.tensor(std).view(view).to(latents) / cfg.scaling_factor
                   + torch.tensor(mean).view(view).to(latents))
    else:
        latents = latents / cfg.scaling_factor
    with torch.no_grad():
        return vae.decode(latents.to(vae.dtype), return_dict=False)[0]


def to_pil(images: Tensor) -> list[Image.Image]:
    """[-1, 1] NCHW -> PIL, rounding as diffusers' image processor does."""
    images = (images / 2 + 0.5).clamp(0, 1)
    arr = images.cpu().permute(0, 2, 3, 1).float().numpy()
    arr = (arr * 255).round().astype(np.uint8)
    if arr.shape[-1] == 1:
        return [Image.fromarray(a[..., 0], mode="L") for a in arr]
    return [Image.fromarray(a) for a in arr]
