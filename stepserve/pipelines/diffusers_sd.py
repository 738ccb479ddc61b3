"""Adapter for the diffusers Stable Diffusion 1.x/2.x family (CLIP text encoder + UNet2DConditionModel +
AutoencoderKL), loaded from a local folder with model_index.json. Nothing is downloaded.

It implements the family interface (family.py): encode prompts (batched, cached), one UNet forward over rows with
per-row timesteps, decode latents to PIL images. Text encoding, latent shapes and decoding follow diffusers'
StableDiffusionPipeline so that images match it for the same seed and settings. It is also the one family the
onnxruntime, TensorRT and Triton backends serve.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from ..backends import Networks
from ..backends.torch_networks import TorchNetworks
from ..request.types import SAMPLER_NAMES, SCHEDULER_CLASSES, ModelInfo, SamplingParams
from .control_inputs import UNetControls
from .family import Conditioning, FamilyAdapter
from .prompt_cache import PromptCache
from .vae import to_pil, vae_scale_factor_of
from .folder import (  # noqa: F401  (EMBEDDED_PATH, resolve_model_path: imported from here by callers)
    EMBEDDED_PATH,
    SERVING_DEFAULTS_FILE,
    PipelineFolder,
    load_local,
    read_scheduler_config,
    resolve_model_path,
    serving_defaults,
    serving_info,
)
from .offload import Offload
from .weights import Weights
from .inpaint import inpaint_mode

__all__ = ["StableDiffusionAdapter", "PromptCache", "to_pil", "resolve_model_path", "model_info_for"]

# Which of our samplers a diffusers scheduler class corresponds to (for the model's own default).
_SCHEDULER_TO_SAMPLER = {cls: sampler for sampler, cls in SCHEDULER_CLASSES.items()}
FALLBACK_SAMPLER = "dpmpp_2m"  # when the folder's scheduler is one we do not implement (e.g. PNDM)
FALLBACK_STEPS = 25
FALLBACK_GUIDANCE = 7.5


class StableDiffusionAdapter(UNetControls, FamilyAdapter):
    """One SD 1/2 pipeline: tokenizer, configs and the three networks (see stepserve.backends for how they run).
    `unet`, `vae` and `text_encoder` are the torch modules on the torch backend and None on the others."""

    family = "sd"
    torch_networks = TorchNetworks
    lora_loader = ("diffusers.loaders.lora_pipeline:StableDiffusionLoraLoaderMixin", "unet")  # stepserve/lora
    unet: Any = None  # the torch UNet (IP-Adapters go into it: capabilities.ImagePromptHooks); None on an export

    def __init__(self, tokenizer, networks: Networks, scheduler_config: dict, info: ModelInfo, *,
                 vae_scaling_factor: float, use_attention_mask: bool = False, backend: str = "torch",
                 unet_in_channels: int = 4, **common) -> None:
        """`common`: FamilyAdapter's other keywords (latent_channels, vae_scale_factor, device, dtype);
        `unet_in_channels`: 9 for an inpainting UNet (mask and masked image as extra channels)."""
        super().__init__(networks, scheduler_config=scheduler_config, info=info, **common)
        self.tokenizer = tokenizer
        self.backend = backend
        self.vae_scaling_factor = vae_scaling_factor
        self.use_attention_mask = use_attention_mask
        self.text_encoder = self.unet = self.vae = None
        if hasattr(networks, "encode_image"):  # image to image and inpainting need the VAE's encoder (torch)
            self.info = replace(self.info, img2img=True,
                                inpaint=inpaint_mode(unet_in_channels, common["latent_channels"]))

    @classmethod
    def from_modules(cls, tokenizer, text_encoder, unet, vae, scheduler_config: dict, info: ModelInfo,
                     device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                     offload: str | None = None) -> "StableDiffusionAdapter":
        """The torch backend: the diffusers/transformers modules themselves, in `dtype`, moved to `device` (or held
        in CPU memory and moved as they run: `offload`, offload.py)."""
        device = torch.device(device)
        place = Offload(offload, device).place
        text_encoder = place(text_encoder.to(dtype)).eval()
        # diffusers models are loaded in their dtype already (from_pretrained(torch_dtype=...)); cast only if not
        unet = place(unet if unet.dtype == dtype else unet.to(dtype=dtype), denoiser=True).eval()
        vae = place(vae if vae.dtype == dtype else vae.to(dtype=dtype)).eval()
        adapter = cls(tokenizer, TorchNetworks(text_encoder, unet, vae), scheduler_config, info,
                      **_options_from_configs(unet.config, vae.config, text_encoder.config), device=device,
                      dtype=dtype)
        adapter.text_encoder, adapter.unet, adapter.vae = text_encoder, unet, vae
        return adapter

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike = "embedded", device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights: Weights | None = None) -> "StableDiffusionAdapter":
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        folder = PipelineFolder.open(model, weights=weights)
        # the text encoder loads in float32 and is cast by from_modules
        tokenizer, text_encoder = folder.load(tokenizer=CLIPTokenizer, text_encoder=CLIPTextModel)
        unet, vae = folder.load(dtype, unet=UNet2DConditionModel, vae=AutoencoderKL)
        scheduler_config = folder.scheduler_config()
        info = model_info_for(folder.name, unet.config, vae.config, scheduler_config, folder.serving_defaults())
        adapter = cls.from_modules(tokenizer, text_encoder, unet, vae, scheduler_config, info, device, dtype,
                                   offload=folder.weights.offload)
        adapter.folder = folder.path  # its other parts (an IP-Adapter's image preparation: stepserve/ipadapter)
        return adapter

    @classmethod
    def from_export_dir(cls, path: str | os.PathLike, networks: Networks, backend: str,
                        device: str | torch.device = "cpu") -> "StableDiffusionAdapter":
        """A pipeline from an exported folder (`stepserve export onnx`: configs, tokenizer and network files),
        with the given networks (onnxruntime sessions, TensorRT engines, or calls to other servers)."""
        from transformers import CLIPTokenizer

        path = Path(path)
        configs = {name: _Config(json.loads((path / name / "config.json").read_text()))
                   for name in ("unet", "vae", "text_encoder")}
        tokenizer = load_local(CLIPTokenizer, path / "tokenizer")
        scheduler_config = read_scheduler_config(path)
        manifest = json.loads((path / "manifest.json").read_text())
        info = model_info_for(manifest["source"]["name"], configs["unet"], configs["vae"], scheduler_config,
                              serving_defaults(path))
        return cls(tokenizer, networks, scheduler_config, info,
                   **_options_from_configs(configs["unet"], configs["vae"], configs["text_encoder"]), device=device,
                   dtype=torch.float32, backend=backend)

    @classmethod
    def from_onnx_dir(cls, path: str | os.PathLike, networks: Networks | None = None, device: str = "cpu",
                      threads: int | None = None) -> "StableDiffusionAdapter":
        """An ONNX export run by onnxruntime (or by `networks`, when given)."""
        if networks is None:
            from ..backends.onnxruntime import OnnxRuntimeNetworks

            networks = OnnxRuntimeNetworks.from_dir(path, threads=threads)
        return cls.from_export_dir(path, networks, "onnxruntime", device)

    # --- text --------------------------------------------------------------------------------------------------
    def _encode_missing(self, prompts: list[str]) -> torch.Tensor:
        """Embeddings (T, D) per prompt (a batch (B, T, D))."""
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
    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        """The same as noise_shape (the name the ONNX export uses)."""
        return self.noise_shape(height, width)

    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, conditioning: dict,
                cache: list | None = None) -> torch.Tensor:
        if cache is not None:
            return super().denoise(sample, timestep, conditioning, cache)
        controls = {k: v for k, v in conditioning.items() if k != "encoder_hidden_states"}  # ControlNet residuals
        return self.unet_forward(sample, timestep, conditioning["encoder_hidden_states"], **controls)

    @torch.no_grad()
    def unet_forward(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: torch.Tensor,
                     **controls) -> torch.Tensor:
        return self.networks.denoise(latents, timesteps, encoder_hidden_states=embeds, **controls)

    @torch.no_grad()
    def image_latents(self, pixels: torch.Tensor, generator) -> torch.Tensor:
        """Images as StableDiffusionImg2ImgPipeline (and the inpaint pipeline) encode them: the VAE's latent
        distribution sampled with the generator(s), times the VAE's scaling factor."""
        return self.networks.encode_image(pixels, generator) * self.vae_scaling_factor

    # --- decoder -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, size: tuple[int, int] | None = None) -> list[Image.Image]:
        images = self.networks.decode(latents / self.vae_scaling_factor)
        return to_pil(images)


def _options_from_configs(unet_config, vae_config, text_encoder_config) -> dict:
    """The adapter's keywords that the networks' configs decide (the same for torch modules and an export)."""
    return dict(latent_channels=unet_config.out_channels, unet_in_channels=unet_config.in_channels,
                vae_scale_factor=vae_scale_factor_of(vae_config),
                vae_scaling_factor=vae_config.scaling_factor,
                use_attention_mask=bool(getattr(text_encoder_config, "use_attention_mask", False)))


class _Config:
    """A saved config.json read back as attributes (unet.in_channels, vae.scaling_factor, ...)."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)


def model_info_for(name: str, unet_config, vae_config, scheduler_config: dict, defaults: dict,
                   **family_rules) -> ModelInfo:
    """Sizes, defaults and samplers of a UNet/VAE pipeline folder; `family_rules`: ModelInfo's family, negative_prompt
    and guidance (what a request may set)."""
    vae_scale = vae_scale_factor_of(vae_config)
    unet_down = 2 ** (len(unet_config.block_out_channels) - 1)
    sample_size = unet_config.sample_size
    sample_size = sample_size if isinstance(sample_size, int) else sample_size[0]
    default_size = sample_size * vae_scale
    multiple = vae_scale * unet_down
    own = _SCHEDULER_TO_SAMPLER.get(scheduler_config.get("_class_name", ""), FALLBACK_SAMPLER)
    samplers = tuple(s for s in SAMPLER_NAMES if s != "flow_euler") if own != "flow_euler" else ("flow_euler",)
    # A folder may narrow the sizes it serves (the embedded model: only the 32x32 it was trained at);
    # otherwise half to twice the UNet's native size.
    return serving_info(name, defaults, size_multiple=multiple, default_size=default_size,
                        min_size=max(multiple, default_size // 2 // multiple * multiple), max_size=default_size * 2,
                        default_sampler=own, default_steps=FALLBACK_STEPS, default_guidance_scale=FALLBACK_GUIDANCE,
                        samplers=samplers, **family_rules)
