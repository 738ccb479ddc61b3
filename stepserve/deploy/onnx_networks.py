"""The three networks of an SD-family pipeline as plain modules with tensor inputs and outputs, ready for
torch.onnx.export: each returns one tensor, and every input has a batch axis (the timestep is per row, so one
denoiser call serves requests at different steps)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


class TextEncoderGraph(nn.Module):
    def __init__(self, text_encoder: nn.Module, with_mask: bool) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.with_mask = with_mask

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.text_encoder(input_ids, attention_mask=attention_mask if self.with_mask else None)[0]


class UNetGraph(nn.Module):
    def __init__(self, unet: nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor) -> Tensor:
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


class VaeDecoderGraph(nn.Module):
    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample: Tensor) -> Tensor:
        return self.vae.decode(latent_sample, return_dict=False)[0]


@dataclass(frozen=True)
class GraphSpec:
    """How one network is exported: its file, input/output names, and which axes of each are dynamic."""

    name: str
    file: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]


def graph_specs(with_mask: bool) -> list[GraphSpec]:
    text_inputs = ("input_ids", "attention_mask") if with_mask else ("input_ids",)
    return [
        GraphSpec("text_encoder", "text_encoder.onnx", text_inputs, ("last_hidden_state",),
                  {**{n: {0: "batch"} for n in text_inputs}, "last_hidden_state": {0: "batch"}}),
        GraphSpec("unet", "unet.onnx", ("sample", "timestep", "encoder_hidden_states"), ("out_sample",),
                  {"sample": {0: "batch", 2: "latent_height", 3: "latent_width"}, "timestep": {0: "batch"},
                   "encoder_hidden_states": {0: "batch"},
                   "out_sample": {0: "batch", 2: "latent_height", 3: "latent_width"}}),
        GraphSpec("vae_decoder", "vae_decoder.onnx", ("latent_sample",), ("sample",),
                  {"latent_sample": {0: "batch", 2: "latent_height", 3: "latent_width"},
                   "sample": {0: "batch", 2: "height", 3: "width"}}),
    ]


def example_inputs(adapter, spec: GraphSpec, batch: int, generator: torch.Generator) -> tuple[Tensor, ...]:
    """Inputs of `batch` rows at the model's default size; timesteps differ per row, as in serving."""
    info = adapter.info
    _, c, h, w = adapter.latent_shape(info.default_height, info.default_width)
    if spec.name == "text_encoder":
        vocab = adapter.tokenizer.vocab_size
        ids = torch.randint(0, vocab, (batch, adapter.tokenizer.model_max_length), generator=generator)
        return (ids, torch.ones_like(ids)) if len(spec.inputs) == 2 else (ids,)
    if spec.name == "unet":
        length = adapter.tokenizer.model_max_length
        dim = adapter.text_encoder.config.hidden_size
        steps = adapter.scheduler_config.get("num_train_timesteps", 1000)
        timestep = torch.randint(0, steps, (batch,), generator=generator).to(torch.float32)
        return (torch.randn(batch, c, h, w, generator=generator), timestep,
                torch.randn(batch, length, dim, generator=generator))
    return (torch.randn(batch, c, h, w, generator=generator),)


def graph_module(adapter, spec: GraphSpec) -> nn.Module:
    if spec.name == "text_encoder":
        return TextEncoderGraph(adapter.text_encoder, len(spec.inputs) == 2).eval()
    if spec.name == "unet":
        return UNetGraph(adapter.unet).eval()
    return VaeDecoderGraph(adapter.vae).eval()
