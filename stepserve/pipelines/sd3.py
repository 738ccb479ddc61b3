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
- timesteps: the flow scheduler's own `set_timesteps(steps)` (no sigmas); with use_dynamic_shifting, `mu` from the
  image token count (latent_h / patch) * (latent_w / patch), so mixed sizes follow mixed schedules. The higher-order
  sampler `dpmpp_2m` is DPMSolverMultistepScheduler in flow mode built from the same config (sampling.flow_shift).
- guidance: true classifier-free guidance, uncond + scale * (cond - uncond) on the velocity, when scale > 1.
- decode: latents / scaling_factor + shift_factor through the VAE.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from .. import sampling
from ..request.types import ModelInfo, SamplingParams
from .control_mmdit import SD3Controls
from .family import Conditioning, FamilyAdapter
from .vae import to_pil, vae_scale_factor_of
from .folder import PipelineFolder, serving_info
from .offload import Offload
from .weights import Weights

PIPELINE_CLASS = "StableDiffusion3Pipeline"
T5_MAX_LENGTH = 256  # the pipeline's max_sequence_length default
DEFAULT_STEPS = 28  # StableDiffusion3Pipeline.__call__ defaults
DEFAULT_GUIDANCE = 7.0
SAMPLERS = ("flow_euler", "dpmpp_2m")  # the flow model's own Euler, and DPM-Solver++(2M) in flow mode


class SD3TorchNetworks:
    """The text encoders (CLIP-L, CLIP-G, T5 or None), transformer and VAE as torch modules; every tensor argument is
    batched on dim 0, so backend wrappers (stepserve.backends.batch_buckets) can pad rows generically."""

    def __init__(self, text_encoders: list, transformer: torch.nn.Module, vae: torch.nn.Module) -> None:
        self.text_encoders = text_encoders
        self.transformer = transformer
        self.vae = vae

    @torch.no_grad()
    def encode_clip(self, input_ids: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """CLIP encoder `index` (0: CLIP-L, 1: CLIP-G): (penultimate hidden state, projected pooled output)."""
        out = self.text_encoders[index](input_ids, output_hidden_states=True)
        return out.hidden_states[-2], out[0]

    @torch.no_grad()
    def encode_t5(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoders[2](input_ids)[0]

    @torch.no_grad()
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, *, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, **controls) -> torch.Tensor:
        """`controls`: ControlNet outputs (block_controlnet_hidden_states), when some row has a control."""
        return self.transformer(hidden_states=sample, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                                pooled_projections=pooled_projections, return_dict=False, **controls)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents, return_dict=False)[0]

    @torch.no_grad()
    def encode_image(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Images in [-1, 1] -> latents sampled with `generator`, (x - shift_factor) * scaling_factor."""
        cfg = self.vae.config
        latents = self.vae.encode(pixels).latent_dist.sample(generator)
        return (latents - cfg.shift_factor) * cfg.scaling_factor


class SD3Adapter(SD3Controls, FamilyAdapter):
    """A loaded SD3 pipeline: tokenizers and text encoders (CLIP-L, CLIP-G, T5 or None), the transformer/VAE
    networks, configs."""

    family = "sd3"
    torch_networks = SD3TorchNetworks
    lora_loader = ("diffusers.loaders.lora_pipeline:SD3LoraLoaderMixin", "transformer")  # stepserve/lora
    prompt_cache_size = 64  # a real SD3 prompt is 333 x 4096 values (2.7 MB in float16)

    def __init__(self, tokenizers: list, networks: SD3TorchNetworks, *, patch_size: int, vae_scaling_factor: float,
                 vae_shift_factor: float, joint_attention_dim: int, **common) -> None:
        """`common`: FamilyAdapter's keywords (scheduler_config, info, latent_channels, vae_scale_factor, device,
        dtype)."""
        if len(tokenizers) != 3 or len(networks.text_encoders) != 3:
            raise ValueError("tokenizers and text encoders must be (CLIP-L, CLIP-G, T5 or None)")
        super().__init__(networks, **common)
        self.tokenizers = tokenizers
        self.patch_size = patch_size
        self.vae_scaling_factor = vae_scaling_factor
        self.vae_shift_factor = vae_shift_factor
        if hasattr(networks, "encode_image"):  # StableDiffusion3Img2ImgPipeline's default strength is 0.6
            self.info = replace(self.info, img2img=True, default_strength=0.6, img2img_start="floor_start")
        self.joint_attention_dim = joint_attention_dim

    @property
    def has_t5(self) -> bool:
        return self.networks.text_encoders[2] is not None

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights: Weights | None = None) -> "SD3Adapter":
        """Load a StableDiffusion3Pipeline folder. text_encoder_3/tokenizer_3 may both be null (or absent) in
        model_index.json: the model then runs without T5, as diffusers does with text_encoder_3=None."""
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel

        folder = PipelineFolder.open(model, PIPELINE_CLASS, weights=weights)
        device = torch.device(device)
        clip_l, clip_g, text_encoder, text_encoder_2 = folder.load(
            dtype, tokenizer=CLIPTokenizer, tokenizer_2=CLIPTokenizer, text_encoder=CLIPTextModelWithProjection,
            text_encoder_2=CLIPTextModelWithProjection)
        tokenizers, encoders = [clip_l, clip_g, None], [text_encoder, text_encoder_2, None]
        if _t5_declared(folder.index, folder.path):
            tokenizers[2], encoders[2] = folder.load(dtype, tokenizer_3=AutoTokenizer, text_encoder_3=T5EncoderModel)
        transformer, vae = folder.load(dtype, transformer=SD3Transformer2DModel, vae=AutoencoderKL)
        place = Offload(folder.weights.offload, device).place
        encoders = [place(e).eval() if e is not None else None for e in encoders]
        transformer, vae = place(transformer, denoiser=True).eval(), place(vae).eval()
        scheduler_config = folder.scheduler_config()
        info = sd3_model_info(folder.name, transformer.config, vae.config, folder.serving_defaults(),
                              scheduler_config)
        return cls(tokenizers, SD3TorchNetworks(encoders, transformer, vae), scheduler_config=scheduler_config,
                   info=info, latent_channels=transformer.config.in_channels,
                   vae_scale_factor=vae_scale_factor_of(vae.config), patch_size=transformer.config.patch_size,
                   vae_scaling_factor=vae.config.scaling_factor, vae_shift_factor=vae.config.shift_factor,
                   joint_attention_dim=transformer.config.joint_attention_dim, device=device, dtype=dtype)

    # --- text --------------------------------------------------------------------------------------------------
    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        """The prompt's row and, when guidance_scale > 1, the negative prompt's ("" when none is given)."""
        guided = [p.guidance_scale > 1 for p in params]
        rows = iter(self.encode_prompts([p.prompt for p in params]
                                        + [p.negative_prompt or "" for p, g in zip(params, guided) if g]))
        conds = [next(rows) for _ in params]
        return [Conditioning(c, next(rows) if g else None) for c, g in zip(conds, guided)]

    def _encode_missing(self, prompts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Per prompt {"encoder_hidden_states": (1, 77 + 256, D), "pooled_projections": (1, P)}:
        StableDiffusion3Pipeline.encode_prompt with prompt_2 = prompt_3 = prompt and clip_skip None."""
        clip_embeds, clip_pooled = zip(*(self._clip(i, prompts) for i in (0, 1)))
        clip = torch.cat(clip_embeds, dim=-1)
        t5 = self._t5(prompts)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        embeds, pooled = torch.cat([clip, t5], dim=-2), torch.cat(clip_pooled, dim=-1)
        return [{"encoder_hidden_states": embeds[i : i + 1], "pooled_projections": pooled[i : i + 1]}
                for i in range(len(prompts))]

    def _clip(self, index: int, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokenizers[index](prompts, padding="max_length", max_length=self.tokenizers[0].model_max_length,
                                     truncation=True, return_tensors="pt").input_ids
        hidden, pooled = self.networks.encode_clip(ids.to(self.device), index)
        return hidden.to(self._text_dtype), pooled  # hidden states in the first text encoder's dtype, as diffusers

    def _t5(self, prompts: list[str]) -> torch.Tensor:
        if not self.has_t5:
            return torch.zeros((len(prompts), T5_MAX_LENGTH, self.joint_attention_dim), device=self.device,
                               dtype=self._text_dtype)
        ids = self.tokenizers[2](prompts, padding="max_length", max_length=T5_MAX_LENGTH, truncation=True,
                                 add_special_tokens=True, return_tensors="pt").input_ids
        return self.networks.encode_t5(ids.to(self.device)).to(self.networks.text_encoders[2].dtype)

    @property
    def _text_dtype(self) -> torch.dtype:
        return self.networks.text_encoders[0].dtype

    # --- schedule and latents ----------------------------------------------------------------------------------
    def schedule_options(self, params: SamplingParams) -> dict:
        """`mu` from the image token count when the scheduler shifts by resolution (the pipeline's calculate_shift);
        no sigmas, as StableDiffusion3Pipeline passes none."""
        if not sampling.uses_dynamic_shifting(self.scheduler_config):
            return {}
        _, _, h, w = self.noise_shape(params.height, params.width)
        seq_len = (h // self.patch_size) * (w // self.patch_size)
        return {"mu": sampling.flow_shift_mu(seq_len, self.scheduler_config)}

    # --- decoder -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def image_latents(self, pixels: torch.Tensor, generator) -> torch.Tensor:
        """StableDiffusion3Img2ImgPipeline.prepare_latents: the images sampled from the VAE, shifted and scaled."""
        return self.networks.encode_image(pixels, generator).to(self.dtype)

    def decode(self, latents: torch.Tensor, size: tuple[int, int] | None = None) -> list[Image.Image]:
        latents = latents / self.vae_scaling_factor + self.vae_shift_factor
        return to_pil(self.networks.decode(latents.to(self.networks.vae.dtype)))


def _t5_declared(index: dict, path: Path) -> bool:
    """Whether the folder has T5: text_encoder_3 and tokenizer_3 both listed in model_index.json (not null) with
    their subfolders, or both left out / null. Anything in between is an error that says what is missing."""
    listed = {name: bool(index.get(name)) and index[name][0] is not None for name in ("text_encoder_3", "tokenizer_3")}
    if listed["text_encoder_3"] != listed["tokenizer_3"]:
        have, lack = ("text_encoder_3", "tokenizer_3") if listed["text_encoder_3"] else ("tokenizer_3", "text_encoder_3")
        raise ValueError(f"model: {path} lists {have} but not {lack} in model_index.json; SD3 needs both for T5, or "
                         "neither (null) to run without T5")
    missing = [name for name, on in listed.items() if on and not (path / name).is_dir()]
    if missing:
        raise ValueError(f"model: {path} lists {', '.join(missing)} in model_index.json but has no such folder")
    return listed["text_encoder_3"]


def _servable_samplers(scheduler_config: dict, default_tokens: int) -> tuple[str, ...]:
    """The samplers whose schedules this scheduler config can build (dpmpp_2m's flow mode refuses a few
    FlowMatchEulerDiscreteScheduler options, e.g. shift_terminal): refused at validation, not mid-run."""
    options = {"mu": sampling.flow_shift_mu(default_tokens, scheduler_config)} \
        if sampling.uses_dynamic_shifting(scheduler_config) else {}
    out = []
    for sampler in SAMPLERS:
        try:
            sampling.build_schedule(sampler, scheduler_config, 2, **options)
        except ValueError:
            continue
        out.append(sampler)
    if not out:
        raise ValueError(f"scheduler: no sampler of {SAMPLERS} supports this scheduler config "
                         f"({scheduler_config.get('_class_name')!r})")
    return tuple(out)


def sd3_model_info(name: str, transformer_config, vae_config, defaults: dict, scheduler_config: dict) -> ModelInfo:
    """Sizes: multiples of vae_scale * patch_size (the pipeline's check); default sample_size * vae_scale (its
    default); at most what the transformer's position embedding covers (pos_embed_max_size patches)."""
    vae_scale = vae_scale_factor_of(vae_config)
    patch = transformer_config.patch_size
    multiple = vae_scale * patch
    default_size = transformer_config.sample_size * vae_scale
    pos_max = transformer_config.pos_embed_max_size
    limit = pos_max * multiple if pos_max else default_size * 2
    samplers = _servable_samplers(scheduler_config, (transformer_config.sample_size // patch) ** 2)
    info = serving_info(name, defaults, size_multiple=multiple, default_size=default_size,
                        min_size=max(multiple, default_size // 2 // multiple * multiple),
                        max_size=min(default_size * 2, limit), size_limit=limit, default_sampler=samplers[0],
                        default_steps=DEFAULT_STEPS, default_guidance_scale=DEFAULT_GUIDANCE, samplers=samplers,
                        family="sd3", negative_prompt=True, guidance="cfg")
    if info.default_sampler not in samplers:
        raise ValueError(f"stepserve.json: default_sampler {info.default_sampler!r} is not one of {samplers}")
    return info
