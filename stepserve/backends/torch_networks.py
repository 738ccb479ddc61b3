"""The pipeline's networks run as PyTorch modules (eager): the reference every other backend is checked against."""

from __future__ import annotations

import torch
from torch import Tensor


class TorchNetworks:
    def __init__(self, text_encoder: torch.nn.Module, unet: torch.nn.Module, vae: torch.nn.Module) -> None:
        self.text_encoder = text_encoder
        self.unet = unet
        self.vae = vae

    @torch.no_grad()
    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        return self.text_encoder(input_ids, attention_mask=attention_mask)[0]

    @torch.no_grad()
    def denoise(self, sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor, **controls) -> Tensor:
        """`controls`: ControlNet residuals (down_block_additional_residuals, mid_block_additional_residual)."""
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False,
                         **controls)[0]

    @property
    def cache_policies(self) -> tuple[str, ...]:
        """The step-caching policies this UNet runs (stepserve/caching)."""
        from ..caching.unet import supports

        return ("fbcache", "deepcache") if supports(self.unet) else ()

    @torch.no_grad()
    def denoise_cached(self, sample: Tensor, timestep: Tensor, rows: list, encoder_hidden_states: Tensor,
                       **controls) -> Tensor:
        """denoise, each row caching as `rows` says (stepserve/caching)."""
        from ..caching.unet import unet_forward

        return unet_forward(self.unet, sample, timestep, encoder_hidden_states, rows, **controls)

    @torch.no_grad()
    def encode_image(self, pixels: Tensor, generator: torch.Generator) -> Tensor:
        """Images in [-1, 1] -> latents sampled from the VAE's distribution with `generator` (diffusers'
        retrieve_latents, sample mode)."""
        return self.vae.encode(pixels).latent_dist.sample(generator)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        return self.vae.decode(latents, return_dict=False)[0]
