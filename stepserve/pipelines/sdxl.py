"""Adapter for Stable Diffusion XL (diffusers' StableDiffusionXLPipeline): two CLIP text encoders (the second with a
projection, whose pooled output conditions the UNet), a UNet2DConditionModel with `addition_embed_type="text_time"`
and an AutoencoderKL. Loaded from a local folder; nothing is downloaded.

What it reproduces of StableDiffusionXLPipeline (diffusers 0.3x), per request:
- prompt embeddings: each tokenizer pads to its own model_max_length (77; longer prompts are truncated), each
  encoder's penultimate hidden state (`hidden_states[-2]`), concatenated on the feature axis; the pooled embedding
  is `text_encoder_2`'s projected output (`text_embeds`). Each tokenizer keeps its own pad token (SDXL's second one
  pads with "!"), read from its folder.
- classifier-free guidance when guidance_scale > 1 (and the UNet has no `time_cond_proj_dim`); with no negative
  prompt and `force_zeros_for_empty_prompt` (model_index.json, default true) the unconditional embeddings are
  zeros, otherwise the negative prompt ("" when none) is encoded like the prompt.
- `add_time_ids = original_size + crops_coords_top_left + target_size` with original_size = target_size = the
  requested (height, width) and crop (0, 0); the unconditional row uses the same ids (negative_original_size and
  negative_target_size default to None).
- decoding with the VAE's latents_mean/std when set, else 1/scaling_factor; a float16 pipeline keeps a
  `force_upcast` VAE in float32 (diffusers upcasts it for every decode). No watermark is applied.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from PIL import Image

from ..request.types import SamplingParams
from .diffusers_sd import model_info_for
from .control_inputs import UNetControls
from .family import Conditioning, FamilyAdapter
from .vae import to_pil, vae_decode, vae_dtype, vae_scale_factor_of
from .folder import PipelineFolder
from .offload import Offload
from .weights import Weights
from .inpaint import inpaint_mode

SDXL_GUIDANCE = 5.0  # StableDiffusionXLPipeline.__call__'s default guidance_scale


def _added(text_embeds: torch.Tensor, time_ids: torch.Tensor, controls: dict) -> dict:
    """The UNet's added conditions: SDXL's text and time ones, and the image embeddings an IP-Adapter's forward
    gives (taken out of `controls`)."""
    return {"text_embeds": text_embeds, "time_ids": time_ids, **controls.pop("added_cond_kwargs", {})}


class SDXLNetworks:
    """The torch modules of an SDXL pipeline behind the three batched calls of stepserve.backends."""

    def __init__(self, text_encoder, text_encoder_2, unet, vae) -> None:
        self.text_encoder, self.text_encoder_2, self.unet, self.vae = text_encoder, text_encoder_2, unet, vae

    @torch.no_grad()
    def encode_text(self, input_ids: torch.Tensor, input_ids_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) ids for each tokenizer -> prompt embeddings (B, T, D1 + D2) and pooled embeddings (B, P)."""
        out = self.text_encoder(input_ids, output_hidden_states=True)
        out_2 = self.text_encoder_2(input_ids_2, output_hidden_states=True)
        embeds = torch.cat([out.hidden_states[-2], out_2.hidden_states[-2]], dim=-1)
        return embeds, out_2[0]

    @torch.no_grad()
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                text_embeds: torch.Tensor, time_ids: torch.Tensor, **controls) -> torch.Tensor:
        """`controls`: ControlNet residuals (down_block_additional_residuals, mid_block_additional_residual) and,
        with an IP-Adapter in the UNet, the rows' image embeddings (added_cond_kwargs: stepserve/ipadapter)."""
        added = _added(text_embeds, time_ids, controls)
        return self.unet(sample, timestep, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added,
                         return_dict=False, **controls)[0]

    @property
    def cache_policies(self) -> tuple[str, ...]:
        """The step-caching policies this UNet runs (stepserve/caching)."""
        from ..caching.unet import supports

        return ("fbcache", "deepcache") if supports(self.unet) else ()

    @torch.no_grad()
    def denoise_cached(self, sample: torch.Tensor, timestep: torch.Tensor, rows: list,
                       encoder_hidden_states: torch.Tensor, text_embeds: torch.Tensor,
                       time_ids: torch.Tensor, **controls) -> torch.Tensor:
        """denoise, each row caching as `rows` says (stepserve/caching)."""
        from ..caching.unet import unet_forward

        added = _added(text_embeds, time_ids, controls)
        return unet_forward(self.unet, sample, timestep, encoder_hidden_states, rows, added_cond_kwargs=added,
                            **controls)

    @torch.no_grad()
    def encode_image(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Images in [-1, 1] -> latents sampled with `generator`, scaled as StableDiffusionXLImg2ImgPipeline does
        (latents_mean/std when the VAE has them, else scaling_factor), in the VAE's dtype (float32 when upcast)."""
        cfg = self.vae.config
        latents = self.vae.encode(pixels.to(self.vae.dtype)).latent_dist.sample(generator)
        mean, std = getattr(cfg, "latents_mean", None), getattr(cfg, "latents_std", None)
        if mean is not None and std is not None:
            view = (1, len(mean), 1, 1)
            return ((latents - torch.tensor(mean).view(view).to(latents)) * cfg.scaling_factor
                    / torch.tensor(std).view(view).to(latents))
        return cfg.scaling_factor * latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the denoiser leaves them -> images in [-1, 1]."""
        return vae_decode(self.vae, latents)


class StableDiffusionXLAdapter(UNetControls, FamilyAdapter):
    family = "sdxl"
    torch_networks = SDXLNetworks
    lora_loader = ("diffusers.loaders.lora_pipeline:StableDiffusionXLLoraLoaderMixin", "unet")  # stepserve/lora

    def __init__(self, tokenizer, tokenizer_2, networks: SDXLNetworks, scheduler_config: dict, info, *,
                 force_zeros_for_empty_prompt: bool = True, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        unet, vae = networks.unet, networks.vae
        if getattr(unet.config, "addition_embed_type", None) != "text_time":
            raise ValueError(f"{info.name}: an SDXL UNet has addition_embed_type 'text_time', this one has "
                             f"{unet.config.addition_embed_type!r}")
        if unet.config.time_cond_proj_dim is not None:
            raise ValueError(f"{info.name}: UNets with time_cond_proj_dim (guidance-distilled, e.g. LCM) are not "
                             f"supported; allowed: time_cond_proj_dim null")
        expected = unet.config.addition_time_embed_dim * 6 + networks.text_encoder_2.config.projection_dim
        if unet.add_embedding.linear_1.in_features != expected:
            raise ValueError(f"{info.name}: the UNet's add embedding takes {unet.add_embedding.linear_1.in_features} "
                             f"features; SDXL's 6 time ids and text_encoder_2's projection give {expected}")
        super().__init__(networks, scheduler_config=scheduler_config, info=info,
                         latent_channels=unet.config.out_channels, vae_scale_factor=vae_scale_factor_of(vae.config),
                         device=device, dtype=dtype)
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        if hasattr(networks, "encode_image"):  # StableDiffusionXLImg2ImgPipeline's default strength is 0.3,
            # StableDiffusionXLInpaintPipeline's 0.9999; an inpainting UNet takes mask and masked image as channels
            self.info = replace(self.info, img2img=True, default_strength=0.3, default_inpaint_strength=0.9999,
                                inpaint=inpaint_mode(unet.config.in_channels, unet.config.out_channels))

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights: Weights | None = None) -> "StableDiffusionXLAdapter":
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        folder = PipelineFolder.open(model, weights=weights)
        missing = [name for name in ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "unet", "vae",
                                     "scheduler") if not (folder.path / name).is_dir()]
        if missing:
            raise FileNotFoundError(f"{folder.path}: an SDXL folder needs the sub-folders {', '.join(missing)}")
        tokenizer, tokenizer_2, text_encoder, text_encoder_2, unet = folder.load(
            dtype, tokenizer=CLIPTokenizer, tokenizer_2=CLIPTokenizer, text_encoder=CLIPTextModel,
            text_encoder_2=CLIPTextModelWithProjection, unet=UNet2DConditionModel)
        [vae] = folder.load(vae=AutoencoderKL)  # then kept in the pipeline's dtype or upcast (vae_dtype)
        if vae.dtype != vae_dtype(vae.config, dtype):
            vae = vae.to(dtype=vae_dtype(vae.config, dtype))
        device = torch.device(device)
        place = Offload(folder.weights.offload, device).place
        networks = SDXLNetworks(place(text_encoder).eval(), place(text_encoder_2).eval(),
                                place(unet, denoiser=True).eval(), place(vae).eval())
        scheduler_config = folder.scheduler_config()
        defaults = {"default_guidance_scale": SDXL_GUIDANCE, **folder.serving_defaults()}
        info = model_info_for(folder.name, unet.config, vae.config, scheduler_config, defaults, family="sdxl")
        adapter = cls(tokenizer, tokenizer_2, networks, scheduler_config, info,
                      force_zeros_for_empty_prompt=bool(folder.index.get("force_zeros_for_empty_prompt", True)),
                      device=device, dtype=dtype)
        adapter.folder = folder.path  # its other parts (an IP-Adapter's image preparation: stepserve/ipadapter)
        return adapter

    # --- text --------------------------------------------------------------------------------------------------
    def _encode_missing(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(embeddings (T, D1 + D2), pooled (P,)) per prompt."""
        ids = [tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
                   return_tensors="pt").input_ids.to(self.device) for tok in (self.tokenizer, self.tokenizer_2)]
        embeds, pooled = self.networks.encode_text(*ids)
        return list(zip(embeds.to(self.dtype), pooled.to(self.dtype)))

    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        guided = [p.guidance_scale > 1 for p in params]
        zeros = [g and not p.negative_prompt and self.force_zeros_for_empty_prompt for p, g in zip(params, guided)]
        encoded = iter(self.encode_prompts(
            [p.prompt for p in params]
            + [p.negative_prompt for p, g, z in zip(params, guided, zeros) if g and not z]))
        conds = [next(encoded) for _ in params]
        out = []
        for p, g, z, (embeds, pooled) in zip(params, guided, zeros, conds):
            time_ids = self.add_time_ids(p.height, p.width)
            cond = {"encoder_hidden_states": embeds[None], "text_embeds": pooled[None], "time_ids": time_ids}
            uncond = None
            if g:
                neg_embeds, neg_pooled = (torch.zeros_like(embeds), torch.zeros_like(pooled)) if z else next(encoded)
                uncond = {"encoder_hidden_states": neg_embeds[None], "text_embeds": neg_pooled[None],
                          "time_ids": time_ids}
            out.append(Conditioning(cond, uncond))
        return out

    def add_time_ids(self, height: int, width: int) -> torch.Tensor:
        """(1, 6): original_size + crops_coords_top_left + target_size, as StableDiffusionXLPipeline's defaults
        (original and target size = the requested size, crop (0, 0))."""
        return torch.tensor([[height, width, 0, 0, height, width]], dtype=self.dtype, device=self.device)

    # --- latents -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def image_latents(self, pixels: torch.Tensor, generator) -> torch.Tensor:
        """StableDiffusionXLImg2ImgPipeline.prepare_latents: the images sampled from the VAE, scaled."""
        return self.networks.encode_image(pixels, generator).to(self.dtype)

    @torch.no_grad()
    def inpaint_latents(self, pixels: torch.Tensor, generator) -> torch.Tensor:
        """StableDiffusionXLInpaintPipeline._encode_vae_image: the VAE's sample (in the VAE's dtype, float32 when
        upcast) in the pipeline's dtype, times scaling_factor (that pipeline applies no latents_mean/std here)."""
        vae = self.networks.vae
        latents = vae.encode(pixels.to(vae.dtype)).latent_dist.sample(generator)
        return vae.config.scaling_factor * latents.to(self.dtype)

    def decode(self, latents: torch.Tensor, size: tuple[int, int] | None = None) -> list[Image.Image]:
        return to_pil(self.networks.decode(latents))

    @property
    def unet(self):
        """The UNet an IP-Adapter goes into (stepserve/ipadapter)."""
        return self.networks.unet
