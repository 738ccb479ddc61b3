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
    def denoise(self, sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor) -> Tensor:
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        return self.vae.decode(latents, return_dict=False)[0]
