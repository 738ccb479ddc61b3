"""How the networks of a pipeline run. Samplers stay in torch on every backend; only the three networks change.

A networks object has three batched methods, torch tensors in and out on the pipeline's device:
- `encode_text(input_ids (B, T) int64, attention_mask (B, T) | None) -> (B, T, D)` prompt embeddings;
- `denoise(sample (B, C, h, w), timestep (B,) float32, encoder_hidden_states (B, T, D)) -> (B, C, h, w)`,
  each row at its own timestep; called with the conditioning as keywords (`networks.denoise(sample, timestep,
  **conditioning)`, every tensor batched on dim 0), so other families add their own (SDXL: text_embeds, time_ids);
- `decode(latents (B, C, h, w), already divided by the VAE scaling factor) -> images (B, C, H, W) in [-1, 1]`.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

class Networks(Protocol):
    def encode_text(self, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor: ...

    def denoise(self, sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor) -> Tensor: ...

    def decode(self, latents: Tensor) -> Tensor: ...
