"""Adapter for the diffusers Stable Diffusion family (CLIP text encoder + UNet2DConditionModel + AutoencoderKL),
loaded from a local folder with model_index.json. Nothing is downloaded.

It exposes the three stages the executor needs, each batched: encode prompts, one UNet forward over rows with
per-row timesteps, decode latents to PIL images. Text encoding, latent shapes and decoding follow diffusers'
StableDiffusionPipeline so that images match it for the same seed and settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..types import SAMPLER_NAMES, SCHEDULER_CLASSES, ModelInfo

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


class PromptCache:
    """A small LRU of prompt -> embedding (T, D), so repeated prompts skip the text encoder."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, prompt: str) -> torch.Tensor | None:
        value = self._items.get(prompt)
        if value is not None:
            self._items.move_to_end(prompt)
            self.hits += 1
        else:
            self.misses += 1
        return value

    def put(self, prompt: str, value: torch.Tensor) -> None:
        self._items[prompt] = value
        self._items.move_to_end(prompt)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


class StableDiffusionAdapter:
    def __init__(self, tokenizer, text_encoder, unet, vae, scheduler_config: dict, info: ModelInfo,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = dtype
        self.text_encoder = text_encoder.to(self.device, dtype).eval()
        # diffusers models are loaded in their dtype already (from_pretrained(torch_dtype=...)); cast only if not
        self.unet = (unet if unet.dtype == dtype else unet.to(dtype=dtype)).to(self.device).eval()
        self.vae = (vae if vae.dtype == dtype else vae.to(dtype=dtype)).to(self.device).eval()
        self.scheduler_config = dict(scheduler_config)
        self.info = info
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.latent_channels = unet.config.in_channels
        self.prompt_cache = PromptCache()

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
        defaults_file = path / SERVING_DEFAULTS_FILE
        defaults = json.loads(defaults_file.read_text()) if defaults_file.is_file() else {}
        info = model_info_for(path.name if str(model) != "embedded" else "embedded", unet, vae, scheduler_config,
                              defaults)
        return cls(tokenizer, text_encoder, unet, vae, scheduler_config, info, device, dtype)

    # --- text --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[torch.Tensor]:
        """Embeddings (T, D) per prompt, batched over the prompts not in the cache."""
        out: dict[str, torch.Tensor] = {}
        missing = []
        for p in prompts:
            if p in out:
                continue
            cached = self.prompt_cache.get(p)
            if cached is None:
                missing.append(p)
            else:
                out[p] = cached
        if missing:
            ids = self.tokenizer(missing, padding="max_length", max_length=self.tokenizer.model_max_length,
                                 truncation=True, return_tensors="pt")
            mask = None
            if getattr(self.text_encoder.config, "use_attention_mask", False):
                mask = ids.attention_mask.to(self.device)
            embeds = self.text_encoder(ids.input_ids.to(self.device), attention_mask=mask)[0].to(self.dtype)
            for p, e in zip(missing, embeds):
                self.prompt_cache.put(p, e)
                out[p] = e
        return [out[p] for p in prompts]

    # --- denoiser ----------------------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        return (1, self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    @torch.no_grad()
    def unet_forward(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return self.unet(latents, timesteps, encoder_hidden_states=embeds, return_dict=False)[0]

    # --- decoder -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> list[Image.Image]:
        images = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
        return to_pil(images)


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[-1, 1] NCHW -> PIL, rounding as diffusers' image processor does."""
    images = (images / 2 + 0.5).clamp(0, 1)
    arr = images.cpu().permute(0, 2, 3, 1).float().numpy()
    arr = (arr * 255).round().astype(np.uint8)
    if arr.shape[-1] == 1:
        return [Image.fromarray(a[..., 0], mode="L") for a in arr]
    return [Image.fromarray(a) for a in arr]


def model_info_for(name: str, unet, vae, scheduler_config: dict, defaults: dict) -> ModelInfo:
    vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
    unet_down = 2 ** (len(unet.config.block_out_channels) - 1)
    sample_size = unet.config.sample_size
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
