"""Stable Diffusion 3 / 3.5 (diffusers `StableDiffusion3Pipeline`): an MMDiT `SD3Transformer2DModel`, three text
encoders (CLIP-L, CLIP-G, optional T5) and a 16-channel `AutoencoderKL` with a shift factor, sampled by flow
matching. Loaded from a local folder (model_index.json); nothing is downloaded.

Every rule below is diffusers 0.42's `StableDiffusion3Pipeline`, so that a served image equals the pipeline's:
- text (`encode_prompt`): each CLIP encoder gives its penultimate hidden state (77 tokens, longer prompts
  truncated) and its projected pooled output; the two token embeddings are concatenated on the feature axis and
  zero-padded to the T5 width (`joint_attention_dim`), then T5's 256 tokens are appended on the sequence axis
  (zeros when the folder has no T5); pooled = [CLIP-L pooled, CLIP-G pooled]. With guidance (> 1) the
  unconditional row encodes the negative prompt, "" when none is given.
- latents: (1, 16, H / vae_scale, W / vae_scale), unit normal from the request's generator.
- timesteps: the flow scheduler's own `set_timesteps(steps)` (no sigmas; `mu` only with use_dynamic_shifting).
- guidance: uncond + scale * (cond - uncond) on the velocity.
- decode: latents / scaling_factor + shift_factor through the VAE.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from ..types import ModelInfo
from .diffusers_sd import (
    PromptCache,
    _loading_bars_only_on_a_terminal,
    model_name,
    resolve_model_path,
    serving_defaults,
    to_pil,
)

PIPELINE_CLASS = "StableDiffusion3Pipeline"
T5_MAX_LENGTH = 256  # the pipeline's max_sequence_length default
DEFAULT_STEPS = 28  # StableDiffusion3Pipeline.__call__ defaults
DEFAULT_GUIDANCE = 7.0
SAMPLERS = ("flow_euler",)


@dataclass
class SD3Conditioning:
    """One prompt's text conditioning: token embeddings (T, D) and pooled embeddings (P,)."""

    embeds: torch.Tensor
    pooled: torch.Tensor


class SD3TorchNetworks:
    """The transformer and VAE as torch modules; every tensor argument is batched on dim 0."""

    def __init__(self, transformer: torch.nn.Module, vae: torch.nn.Module) -> None:
        self.transformer = transformer
        self.vae = vae

    @torch.no_grad()
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, *, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor) -> torch.Tensor:
        return self.transformer(hidden_states=sample, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents, return_dict=False)[0]


def is_sd3_folder(path: Path) -> bool:
    index = path / "model_index.json"
    return index.is_file() and json.loads(index.read_text()).get("_class_name") == PIPELINE_CLASS


class SD3Adapter:
    """A loaded SD3 pipeline: tokenizers and text encoders (torch), the denoiser/VAE networks, configs."""

    def __init__(self, tokenizers: list, text_encoders: list, networks: SD3TorchNetworks, *, scheduler_config: dict,
                 info: ModelInfo, latent_channels: int, vae_scale_factor: int, vae_scaling_factor: float,
                 vae_shift_factor: float, joint_attention_dim: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, prompt_cache_size: int = 64) -> None:
        if len(tokenizers) != 3 or len(text_encoders) != 3:
            raise ValueError("tokenizers and text_encoders must hold (CLIP-L, CLIP-G, T5 or None)")
        self.tokenizers = tokenizers
        self.text_encoders = text_encoders
        self.networks = networks
        self.scheduler_config = dict(scheduler_config)
        self.info = info
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor
        self.vae_scaling_factor = vae_scaling_factor
        self.vae_shift_factor = vae_shift_factor
        self.joint_attention_dim = joint_attention_dim
        self.device = torch.device(device)
        self.dtype = dtype
        # Real SD3 prompts are 333 x 4096 values each: keep the cache small.
        self.prompt_cache = PromptCache(prompt_cache_size)

    @property
    def has_t5(self) -> bool:
        return self.text_encoders[2] is not None

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, device: str = "cpu",
                        dtype: torch.dtype = torch.float32) -> "SD3Adapter":
        """Load a StableDiffusion3Pipeline folder. text_encoder_3/tokenizer_3 may be absent from the folder or set to
        null in model_index.json: the model then runs without T5, as diffusers does with text_encoder_3=None."""
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel

        path = resolve_model_path(model)
        index = json.loads((path / "model_index.json").read_text())
        if index.get("_class_name") != PIPELINE_CLASS:
            raise ValueError(f"model: {path} holds a {index.get('_class_name')!r}, not a {PIPELINE_CLASS}")
        device = torch.device(device)
        with _loading_bars_only_on_a_terminal():
            tokenizers = [CLIPTokenizer.from_pretrained(path / "tokenizer"),
                          CLIPTokenizer.from_pretrained(path / "tokenizer_2"), None]
            encoders = [CLIPTextModelWithProjection.from_pretrained(path / "text_encoder", torch_dtype=dtype),
                        CLIPTextModelWithProjection.from_pretrained(path / "text_encoder_2", torch_dtype=dtype), None]
            if _component_present(index, path, "text_encoder_3") and _component_present(index, path, "tokenizer_3"):
                tokenizers[2] = AutoTokenizer.from_pretrained(path / "tokenizer_3")
                encoders[2] = T5EncoderModel.from_pretrained(path / "text_encoder_3", torch_dtype=dtype)
            transformer = SD3Transformer2DModel.from_pretrained(path / "transformer", torch_dtype=dtype)
            vae = AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dtype)
        encoders = [e.to(device).eval() if e is not None else None for e in encoders]
        transformer, vae = transformer.to(device).eval(), vae.to(device).eval()
        scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        info = sd3_model_info(model_name(model, path), transformer.config, vae.config, serving_defaults(path))
        return cls(tokenizers, encoders, SD3TorchNetworks(transformer, vae), scheduler_config=scheduler_config,
                   info=info, latent_channels=transformer.config.in_channels,
                   vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
                   vae_scaling_factor=vae.config.scaling_factor, vae_shift_factor=vae.config.shift_factor,
                   joint_attention_dim=transformer.config.joint_attention_dim, device=device, dtype=dtype)

    # --- text --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[SD3Conditioning]:
        """Conditioning per prompt, batched over the distinct prompts not in the cache."""
        out: dict[str, SD3Conditioning] = {}
        missing = []
        for p in prompts:
            if p not in out and p not in missing:
                cached = self.prompt_cache.get(p)
                if cached is None:
                    missing.append(p)
                else:
                    out[p] = cached
        if missing:
            embeds, pooled = self._encode(missing)
            for i, p in enumerate(missing):
                out[p] = SD3Conditioning(embeds[i], pooled[i])
                self.prompt_cache.put(p, out[p])
        return [out[p] for p in prompts]

    def _encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        # StableDiffusion3Pipeline.encode_prompt with prompt_2 = prompt_3 = prompt and clip_skip None.
        clip_embeds, clip_pooled = zip(*(self._clip(i, prompts) for i in (0, 1)))
        clip = torch.cat(clip_embeds, dim=-1)
        t5 = self._t5(prompts)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat(clip_pooled, dim=-1)

    def _clip(self, index: int, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tokenizer, encoder = self.tokenizers[index], self.text_encoders[index]
        ids = tokenizer(prompts, padding="max_length", max_length=self.tokenizers[0].model_max_length,
                        truncation=True, return_tensors="pt").input_ids
        out = encoder(ids.to(self.device), output_hidden_states=True)
        # penultimate hidden state, in the first text encoder's dtype; pooled (text_embeds) as is
        return out.hidden_states[-2].to(self.text_encoders[0].dtype), out[0]

    def _t5(self, prompts: list[str]) -> torch.Tensor:
        if not self.has_t5:
            return torch.zeros((len(prompts), T5_MAX_LENGTH, self.joint_attention_dim), device=self.device,
                               dtype=self.text_encoders[0].dtype)
        ids = self.tokenizers[2](prompts, padding="max_length", max_length=T5_MAX_LENGTH, truncation=True,
                                 add_special_tokens=True, return_tensors="pt").input_ids
        return self.text_encoders[2](ids.to(self.device))[0].to(self.text_encoders[2].dtype)

    # --- denoiser ----------------------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        return (1, self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    @torch.no_grad()
    def denoise(self, rows: torch.Tensor, timesteps: torch.Tensor, conds: list[SD3Conditioning]) -> torch.Tensor:
        """One transformer forward; row i at timesteps[i] with conditioning conds[i]."""
        return self.networks.denoise(rows, timesteps, encoder_hidden_states=torch.stack([c.embeds for c in conds]),
                                     pooled_projections=torch.stack([c.pooled for c in conds]))

    # --- decoder -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> list[Image.Image]:
        latents = latents / self.vae_scaling_factor + self.vae_shift_factor
        return to_pil(self.networks.decode(latents.to(self.dtype)))


def _component_present(index: dict, path: Path, name: str) -> bool:
    entry = index.get(name)
    return bool(entry) and entry[0] is not None and (path / name).is_dir()


def sd3_model_info(name: str, transformer_config, vae_config, defaults: dict) -> ModelInfo:
    """Sizes: multiples of vae_scale * patch_size (the pipeline's check); default sample_size * vae_scale (its
    default); at most what the transformer's position embedding covers (pos_embed_max_size patches)."""
    vae_scale = 2 ** (len(vae_config.block_out_channels) - 1)
    patch = transformer_config.patch_size
    multiple = vae_scale * patch
    default_size = transformer_config.sample_size * vae_scale
    pos_max = transformer_config.pos_embed_max_size
    limit = pos_max * multiple if pos_max else default_size * 2
    height = int(defaults.get("height", default_size))
    width = int(defaults.get("width", default_size))
    min_size = int(defaults.get("min_size", max(multiple, default_size // 2 // multiple * multiple)))
    max_size = int(defaults.get("max_size", min(default_size * 2, limit)))
    if min_size % multiple or max_size % multiple or max_size > limit or \
            not min_size <= min(height, width) <= max(height, width) <= max_size:
        raise ValueError(f"stepserve.json: min_size {min_size} and max_size {max_size} must be multiples of "
                         f"{multiple}, at most {limit}, around the default size {width}x{height}")
    return ModelInfo(
        name=name,
        default_sampler=defaults.get("default_sampler", "flow_euler"),
        default_steps=int(defaults.get("default_steps", DEFAULT_STEPS)),
        default_guidance_scale=float(defaults.get("default_guidance_scale", DEFAULT_GUIDANCE)),
        default_height=height,
        default_width=width,
        size_multiple=multiple,
        min_size=min_size,
        max_size=max_size,
        samplers=SAMPLERS,
    )
