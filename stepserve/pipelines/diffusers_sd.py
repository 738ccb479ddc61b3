"""Adapter for the diffusers Stable Diffusion 1.x/2.x family (CLIP text encoder + UNet2DConditionModel +
AutoencoderKL), loaded from a local folder with model_index.json. Nothing is downloaded.

It implements the family interface (family.py): encode prompts (batched, cached), one UNet forward over rows with
per-row timesteps, decode latents to PIL images. Text encoding, latent shapes and decoding follow diffusers'
StableDiffusionPipeline so that images match it for the same seed and settings. It is also the one family the
onnxruntime, TensorRT and Triton backends serve.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from PIL import Image

from ..backends import Networks
from ..backends.torch_networks import TorchNetworks
from ..types import SAMPLER_NAMES, SCHEDULER_CLASSES, ModelInfo, SamplingParams
from .family import Conditioning, FamilyAdapter, PromptCache, to_pil

__all__ = ["StableDiffusionAdapter", "PromptCache", "to_pil", "resolve_model_path", "model_info_for"]

# Which of our samplers a diffusers scheduler class corresponds to (for the model's own default).
_SCHEDULER_TO_SAMPLER = {cls: sampler for sampler, cls in SCHEDULER_CLASSES.items()}
FALLBACK_SAMPLER = "dpmpp_2m"  # when the folder's scheduler is one we do not implement (e.g. PNDM)
FALLBACK_STEPS = 25
FALLBACK_GUIDANCE = 7.5
SERVING_DEFAULTS_FILE = "stepserve.json"
EMBEDDED_PATH = Path(__file__).resolve().parent.parent / "models" / "embedded"


def resolve_model_path(model: str | os.PathLike) -> Path:
    """'embedded' -> the model that ships with stepserve; otherwise a local diffusers folder."""
    path = EMBEDDED_PATH if str(model) == "embedded" else Path(model).expanduser()
    if not (path / "model_index.json").is_file():
        if str(model) == "embedded":
            raise FileNotFoundError(f"the embedded model is missing from the installation ({path})")
        raise FileNotFoundError(
            f"model: {str(model)!r} is neither 'embedded' nor a local diffusers folder with model_index.json"
        )
    return path


class StableDiffusionAdapter(FamilyAdapter):
    """One SD 1/2 pipeline: tokenizer, configs and the three networks (see stepserve.backends for how they run).
    `unet`, `vae` and `text_encoder` are the torch modules on the torch backend and None on the others."""

    family = "sd"

    def __init__(self, tokenizer, networks: Networks, scheduler_config: dict, info: ModelInfo, *,
                 latent_channels: int, vae_scale_factor: int, vae_scaling_factor: float,
                 use_attention_mask: bool = False, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, backend: str = "torch") -> None:
        self.tokenizer = tokenizer
        self.networks = networks
        self.device = torch.device(device)
        self.dtype = dtype
        self.backend = backend
        self.scheduler_config = dict(scheduler_config)
        self.info = info
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor
        self.vae_scaling_factor = vae_scaling_factor
        self.use_attention_mask = use_attention_mask
        self.prompt_cache = PromptCache()
        self.text_encoder = self.unet = self.vae = None

    @classmethod
    def from_modules(cls, tokenizer, text_encoder, unet, vae, scheduler_config: dict, info: ModelInfo,
                     device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
                     ) -> "StableDiffusionAdapter":
        """The torch backend: the diffusers/transformers modules themselves, moved to `device` and `dtype`."""
        device = torch.device(device)
        text_encoder = text_encoder.to(device, dtype).eval()
        # diffusers models are loaded in their dtype already (from_pretrained(torch_dtype=...)); cast only if not
        unet = (unet if unet.dtype == dtype else unet.to(dtype=dtype)).to(device).eval()
        vae = (vae if vae.dtype == dtype else vae.to(dtype=dtype)).to(device).eval()
        adapter = cls(tokenizer, TorchNetworks(text_encoder, unet, vae), scheduler_config, info,
                      latent_channels=unet.config.in_channels,
                      vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
                      vae_scaling_factor=vae.config.scaling_factor,
                      use_attention_mask=bool(getattr(text_encoder.config, "use_attention_mask", False)),
                      device=device, dtype=dtype)
        adapter.text_encoder, adapter.unet, adapter.vae = text_encoder, unet, vae
        return adapter

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "embedded", device: str = "cpu",
                        dtype: torch.dtype = torch.float32) -> "StableDiffusionAdapter":
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        path = resolve_model_path(model)
        with _loading_bars_only_on_a_terminal():
            tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
            text_encoder = CLIPTextModel.from_pretrained(path / "text_encoder")
            unet = UNet2DConditionModel.from_pretrained(path / "unet", torch_dtype=dtype)
            vae = AutoencoderKL.from_pretrained(path / "vae", torch_dtype=dtype)
        scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        info = model_info_for(model_name(model, path), unet.config, vae.config, scheduler_config,
                              serving_defaults(path))
        return cls.from_modules(tokenizer, text_encoder, unet, vae, scheduler_config, info, device, dtype)

    @classmethod
    def from_export_dir(cls, path: str | os.PathLike, networks: Networks, backend: str,
                        device: str | torch.device = "cpu") -> "StableDiffusionAdapter":
        """A pipeline from an exported folder (`stepserve export onnx`: configs, tokenizer and network files),
        with the given networks (onnxruntime sessions, TensorRT engines, or calls to other servers)."""
        from transformers import CLIPTokenizer

        path = Path(path)
        configs = {name: _Config(json.loads((path / name / "config.json").read_text()))
                   for name in ("unet", "vae", "text_encoder")}
        tokenizer = CLIPTokenizer.from_pretrained(path / "tokenizer")
        scheduler_config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        manifest = json.loads((path / "manifest.json").read_text())
        info = model_info_for(manifest["source"]["name"], configs["unet"], configs["vae"], scheduler_config,
                              serving_defaults(path))
        return cls(tokenizer, networks, scheduler_config, info,
                   latent_channels=configs["unet"].in_channels,
                   vae_scale_factor=2 ** (len(configs["vae"].block_out_channels) - 1),
                   vae_scaling_factor=configs["vae"].scaling_factor,
                   use_attention_mask=bool(getattr(configs["text_encoder"], "use_attention_mask", False)),
                   device=device, dtype=torch.float32, backend=backend)

    @classmethod
    def from_onnx_dir(cls, path: str | os.PathLike, networks: Networks | None = None, device: str = "cpu",
                      threads: int | None = None) -> "StableDiffusionAdapter":
        """An ONNX export run by onnxruntime (or by `networks`, when given)."""
        if networks is None:
            from ..backends.onnxruntime import OnnxRuntimeNetworks

            networks = OnnxRuntimeNetworks.from_dir(path, threads=threads)
        return cls.from_export_dir(path, networks, "onnxruntime", device)

    # --- text --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[torch.Tensor]:
        """Embeddings (T, D) per prompt, batched over the prompts not in the cache."""
        return self.prompt_cache.encode(prompts, self._encode_missing)

    def _encode_missing(self, prompts: list[str]) -> torch.Tensor:
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt")
        mask = ids.attention_mask.to(self.device) if self.use_attention_mask else None
        return self.networks.encode_text(ids.input_ids.to(self.device), mask).to(self.dtype)

    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        """The prompt's embeddings, and the negative prompt's (the unconditional row) when guidance_scale > 1, as
        StableDiffusionPipeline does (it encodes "" when no negative prompt is given)."""
        guided = [p.guidance_scale > 1 for p in params]
        embeds = iter(self.encode_prompts([p.prompt for p in params]
                                          + [p.negative_prompt for p, g in zip(params, guided) if g]))
        conds = [{"encoder_hidden_states": next(embeds)[None]} for _ in params]
        return [Conditioning(c, {"encoder_hidden_states": next(embeds)[None]} if g else None)
                for c, g in zip(conds, guided)]

    # --- denoiser ----------------------------------------------------------------------------------------------
    def noise_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        return (1, self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    latent_shape = noise_shape

    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, conditioning: dict) -> torch.Tensor:
        return self.unet_forward(sample, timestep, conditioning["encoder_hidden_states"])

    @torch.no_grad()
    def unet_forward(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return self.networks.denoise(latents, timesteps, encoder_hidden_states=embeds)

    # --- decoder -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, size: tuple[int, int] | None = None) -> list[Image.Image]:
        images = self.networks.decode(latents / self.vae_scaling_factor)
        return to_pil(images)


def model_name(model: str | os.PathLike, path: Path) -> str:
    return "embedded" if str(model) == "embedded" else path.name


def serving_defaults(path: Path) -> dict:
    """The folder's stepserve.json (serving defaults and allowed sizes), or {}."""
    defaults_file = path / SERVING_DEFAULTS_FILE
    return json.loads(defaults_file.read_text()) if defaults_file.is_file() else {}


class _Config:
    """A saved config.json read back as attributes (unet.in_channels, vae.scaling_factor, ...)."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)


def model_info_for(name: str, unet_config, vae_config, scheduler_config: dict, defaults: dict,
                   **family_rules) -> ModelInfo:
    """Sizes, defaults and samplers of a UNet/VAE pipeline folder; `family_rules`: ModelInfo's family, negative_prompt
    and guidance (what a request may set)."""
    vae_scale = 2 ** (len(vae_config.block_out_channels) - 1)
    unet_down = 2 ** (len(unet_config.block_out_channels) - 1)
    sample_size = unet_config.sample_size
    sample_size = sample_size if isinstance(sample_size, int) else sample_size[0]
    default_size = sample_size * vae_scale
    multiple = vae_scale * unet_down
    own = _SCHEDULER_TO_SAMPLER.get(scheduler_config.get("_class_name", ""), FALLBACK_SAMPLER)
    samplers = tuple(s for s in SAMPLER_NAMES if s != "flow_euler") if own != "flow_euler" else ("flow_euler",)
    height = int(defaults.get("height", default_size))
    width = int(defaults.get("width", default_size))
    # A folder may narrow the sizes it serves (the embedded model: only the 32x32 it was trained at);
    # otherwise half to twice the UNet's native size.
    min_size = int(defaults.get("min_size", max(multiple, default_size // 2 // multiple * multiple)))
    max_size = int(defaults.get("max_size", default_size * 2))
    if min_size % multiple or max_size % multiple or not min_size <= min(height, width) <= max(height, width) \
            <= max_size:
        raise ValueError(f"{SERVING_DEFAULTS_FILE}: min_size {min_size} and max_size {max_size} must be multiples "
                         f"of {multiple} around the default size {width}x{height}")
    return ModelInfo(
        name=name,
        default_sampler=defaults.get("default_sampler", own),
        default_steps=int(defaults.get("default_steps", FALLBACK_STEPS)),
        default_guidance_scale=float(defaults.get("default_guidance_scale", FALLBACK_GUIDANCE)),
        default_height=height,
        default_width=width,
        size_multiple=multiple,
        min_size=min_size,
        max_size=max_size,
        samplers=samplers,
        **family_rules,
    )


@contextlib.contextmanager
def _loading_bars_only_on_a_terminal() -> Iterator[None]:
    """transformers and diffusers draw their own weight-loading bars; in a log (stderr not a terminal) those are
    carriage-return noise, so they are turned off while loading and restored after."""
    if sys.stderr.isatty():
        yield
        return
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    states = [(m, m.is_progress_bar_enabled()) for m in (diffusers_logging, transformers_logging)]
    for m, _ in states:
        m.disable_progress_bar()
    try:
        yield
    finally:
        for m, enabled in states:
            if enabled:
                m.enable_progress_bar()
