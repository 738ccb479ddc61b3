"""Flux.1 (diffusers `FluxPipeline`, dev and schnell): a `FluxTransformer2DModel` (double- and single-stream MMDiT
blocks with 3-axis RoPE), CLIP (pooled output) + T5 (token embeddings) text encoders and a 16-channel
`AutoencoderKL` with a shift factor, sampled by flow matching. Loaded from a local folder; nothing is downloaded.

Every rule below is diffusers 0.42's `FluxPipeline`, so that a served image equals the pipeline's:
- text (`encode_prompt`, prompt_2 = prompt): CLIP's `pooler_output` over `tokenizer.model_max_length` (77) tokens,
  longer prompts truncated; T5's last hidden state over `max_sequence_length` tokens (512 by default), padded to
  it; `text_ids` are zeros (T, 3).
- latents: unit normal noise of shape (1, C, 2 * (H // (2 * vae_scale)), 2 * (W // (2 * vae_scale))) drawn from
  the request's generator, then packed into 2x2 patches, (1, h/2 * w/2, 4C) (`_pack_latents`); `img_ids` give
  each patch (0, row, column) (`_prepare_latent_image_ids`). Samplers step the packed latents, as the pipeline's
  scheduler does.
- timesteps: `set_timesteps(sigmas=np.linspace(1, 1/n, n), mu=calculate_shift(image tokens))`; with
  use_dynamic_shifting (dev) `mu` moves the schedule, so requests of different sizes follow different schedules.
- guidance: the dev transformer embeds the guidance value (`guidance_embeds`): one row per request, the value in
  that row; schnell has no guidance input and ignores the value. True CFG (`true_cfg_scale` with a negative
  prompt) is not served: negative prompts are refused by validation (ModelInfo.negative_prompt False).
- the transformer gets `timestep / 1000` in the latents' dtype; decode: unpack, / scaling_factor + shift_factor.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
from PIL import Image

from .. import sampling
from ..request.types import ModelInfo, SamplingParams
from ..util.shards import shard_residuals
from .control_inputs import FluxControls
from .family import Conditioning, FamilyAdapter
from .vae import to_pil, vae_scale_factor_of
from .folder import PipelineFolder, serving_info
from .offload import Offload
from .weights import Weights

PIPELINE_CLASSES = ("FluxPipeline", "FluxFillPipeline")  # Fill: inpainting, mask and masked image as channels
FILL_GUIDANCE = 30.0  # FluxFillPipeline.__call__'s default guidance_scale
T5_MAX_LENGTH = 512  # FluxPipeline's max_sequence_length default (and its upper bound)
DEFAULT_SAMPLE_SIZE = 128  # FluxPipeline.default_sample_size: default height/width = 128 * vae_scale_factor
DEFAULT_STEPS = 28  # FluxPipeline.__call__ defaults
DEFAULT_GUIDANCE = 3.5


class FluxTorchNetworks:
    """The text encoders, transformer and VAE as torch modules. In `denoise` every tensor is batched on dim 0
    except the position ids `img_ids` / `txt_ids`, (sequence, 3), shared by the rows of one size bucket."""

    def __init__(self, text_encoder, text_encoder_2, transformer, vae) -> None:
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.transformer = transformer
        self.vae = vae

    @torch.no_grad()
    def encode_pooled(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids, output_hidden_states=False).pooler_output

    @torch.no_grad()
    def encode_t5(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text_encoder_2(input_ids, output_hidden_states=False)[0]

    @torch.no_grad()
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, *, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor,
                guidance: torch.Tensor | None = None, **controls) -> torch.Tensor:
        """`controls`: ControlNet outputs (controlnet_block_samples, controlnet_single_block_samples), whole: cut
        here to the tokens this rank's blocks run when the transformer is split (--ulysses-degree)."""
        controls = shard_residuals(controls, self.transformer)
        return self.transformer(hidden_states=sample, timestep=timestep, guidance=guidance,
                                pooled_projections=pooled_projections, encoder_hidden_states=encoder_hidden_states,
                                txt_ids=txt_ids, img_ids=img_ids, return_dict=False, **controls)[0]

    cache_policies = ("fbcache", "magcache")  # stepserve/caching

    @torch.no_grad()
    def encode_image(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Images in [-1, 1] -> latents sampled with `generator`, (x - shift_factor) * scaling_factor (unpacked)."""
        cfg = self.vae.config
        latents = self.vae.encode(pixels).latent_dist.sample(generator)
        return (latents - cfg.shift_factor) * cfg.scaling_factor

    @torch.no_grad()
    def denoise_cached(self, sample: torch.Tensor, timestep: torch.Tensor, rows: list, *,
                       encoder_hidden_states: torch.Tensor, pooled_projections: torch.Tensor, img_ids: torch.Tensor,
                       txt_ids: torch.Tensor, guidance: torch.Tensor | None = None, **controls) -> torch.Tensor:
        """denoise, each row caching as `rows` says (stepserve/caching)."""
        from ..caching.flux import flux_forward

        return flux_forward(self.transformer, sample, timestep, encoder_hidden_states=encoder_hidden_states,
                            pooled_projections=pooled_projections, img_ids=img_ids, txt_ids=txt_ids,
                            guidance=guidance, rows=rows, **controls)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents, return_dict=False)[0]


def check_text_split(name: str, tokens: int, n: int) -> None:
    """A family whose sequence-parallel plan splits its text of `tokens` (fixed: max_sequence_length) over `n`
    ranks, as the image tokens: they must divide (diffusers' sharder cuts equal pieces)."""
    if tokens % n:
        raise ValueError(f"a sequence degree of {n} (--ulysses-degree x --ring-degree) splits {name}'s "
                         f"{tokens} text tokens (max_sequence_length) too, and they do not divide; allowed: a "
                         f"degree that divides {tokens}, or a max_sequence_length that {n} divides (stepserve.json)")


def latent_grid(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    """The unpacked latent size (h, w) FluxPipeline uses for an image: even, so that 2x2 patches tile it."""
    return 2 * (int(height) // (vae_scale_factor * 2)), 2 * (int(width) // (vae_scale_factor * 2))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): FluxPipeline._pack_latents."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h/2 * w/2, 4C) -> (B, C, h, w): FluxPipeline._unpack_latents (h, w: the latent grid)."""
    b, _, channels = latents.shape
    latents = latents.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, h, w)


def latent_image_ids(h: int, w: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """(h/2 * w/2, 3) position ids (0, row, column) of the packed patches: FluxPipeline._prepare_latent_image_ids."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h // 2)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


class FluxAdapter(FluxControls, FamilyAdapter):
    """A loaded Flux.1 pipeline: tokenizers, the networks (torch), configs."""

    family = "flux"
    torch_networks = FluxTorchNetworks
    image_processor_scale = 2  # FluxImg2ImgPipeline's VaeImageProcessor works in 2x2 latent patches
    lora_loader = ("diffusers.loaders.lora_pipeline:FluxLoraLoaderMixin", "transformer")  # stepserve/lora
    prompt_cache_size = 64  # a real Flux prompt is 512 x 4096 values

    inpaint_from_image = True  # FluxFillPipeline.prepare_latents encodes the image at every strength

    def __init__(self, tokenizer, tokenizer_2, networks: FluxTorchNetworks, *, vae_scaling_factor: float,
                 vae_shift_factor: float, guidance_embeds: bool, max_sequence_length: int = T5_MAX_LENGTH,
                 fill: bool = False, **common) -> None:
        """`common`: FamilyAdapter's keywords (scheduler_config, info, latent_channels, vae_scale_factor, device,
        dtype); `fill`: a Flux Fill transformer (mask and masked image as extra input channels)."""
        if not 1 <= max_sequence_length <= T5_MAX_LENGTH:
            raise ValueError(f"max_sequence_length must be in 1..{T5_MAX_LENGTH} (FluxPipeline's bound); "
                             f"got {max_sequence_length!r}")
        super().__init__(networks, **common)
        self.tokenizer = tokenizer
        self.tokenizer_2 = tokenizer_2
        self.vae_scaling_factor = vae_scaling_factor
        self.vae_shift_factor = vae_shift_factor
        if hasattr(networks, "encode_image"):  # FluxImg2ImgPipeline's default strength is 0.6, FluxFillPipeline's 1
            self.info = replace(self.info, img2img=True, default_strength=0.6, img2img_start="floor_start",
                                inpaint="channels" if fill else "", default_inpaint_strength=1.0)
        self.guidance_embeds = guidance_embeds
        self.max_sequence_length = max_sequence_length

    def check_sequence_degree(self, n: int) -> None:
        """diffusers' Flux.1 plan splits the T5 tokens with the image tokens: all max_sequence_length of them."""
        check_text_split(self.info.name, self.max_sequence_length, n)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights: Weights | None = None) -> "FluxAdapter":
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import AutoTokenizer, CLIPTextModel, CLIPTokenizer, T5EncoderModel

        folder = PipelineFolder.open(model, PIPELINE_CLASSES, weights=weights)
        device = torch.device(device)
        tokenizer, tokenizer_2, text_encoder, text_encoder_2, transformer, vae = folder.load(
            dtype, tokenizer=CLIPTokenizer, tokenizer_2=AutoTokenizer, text_encoder=CLIPTextModel,
            text_encoder_2=T5EncoderModel, transformer=FluxTransformer2DModel, vae=AutoencoderKL)
        place = Offload(folder.weights.offload, device).place
        modules = [place(m, denoiser=m is transformer).eval() for m in (text_encoder, text_encoder_2, transformer, vae)]
        scheduler_config = folder.scheduler_config()
        defaults = folder.serving_defaults()
        vae_scale = vae_scale_factor_of(vae.config)
        channels = vae.config.latent_channels
        fill = fill_transformer(transformer.config.in_channels, channels, vae_scale)
        info = flux_model_info(folder.name, vae_scale, scheduler_config, defaults,
                               guidance_embeds=transformer.config.guidance_embeds, fill=fill)
        return cls(tokenizer, tokenizer_2, FluxTorchNetworks(*modules), scheduler_config=scheduler_config,
                   info=info, latent_channels=channels, vae_scale_factor=vae_scale, fill=fill,
                   vae_scaling_factor=vae.config.scaling_factor, vae_shift_factor=vae.config.shift_factor,
                   guidance_embeds=transformer.config.guidance_embeds,
                   max_sequence_length=int(defaults.get("max_sequence_length", T5_MAX_LENGTH)),
                   device=device, dtype=dtype)

    # --- text --------------------------------------------------------------------------------------------------
    def _encode_missing(self, prompts: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(T5 embeddings (T, D), CLIP pooled (P,)) per prompt."""
        clip_ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").input_ids
        pooled = self.networks.encode_pooled(clip_ids.to(self.device)).to(self.dtype)
        t5_ids = self.tokenizer_2(prompts, padding="max_length", max_length=self.max_sequence_length,
                                  truncation=True, return_tensors="pt").input_ids
        embeds = self.networks.encode_t5(t5_ids.to(self.device)).to(self.dtype)
        return list(zip(embeds, pooled))

    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        """One row per request: text embeddings, pooled embeddings, the size's image ids and (dev) the guidance
        value; no unconditional row (guidance is embedded, not classifier-free)."""
        out = []
        for p, (embeds, pooled) in zip(params, self.encode_prompts([p.prompt for p in params])):
            if p.negative_prompt:
                raise ValueError(f"negative_prompt: {self.info.name} (flux) takes no negative prompt; allowed: empty")
            cond = {"encoder_hidden_states": embeds[None], "pooled_projections": pooled[None],
                    "img_ids": latent_image_ids(*self.grid(p.height, p.width), self.device, self.dtype)[None]}
            if self.guidance_embeds:  # FluxPipeline: torch.full([1], guidance_scale, dtype=torch.float32)
                cond["guidance"] = torch.full([1], p.guidance_scale, device=self.device, dtype=torch.float32)
            out.append(Conditioning(cond))
        return out

    # --- schedule and latents ----------------------------------------------------------------------------------
    def grid(self, height: int, width: int) -> tuple[int, int]:
        return latent_grid(height, width, self.vae_scale_factor)

    def schedule_options(self, params: SamplingParams) -> dict:
        """FluxPipeline's sigmas (np.linspace(1, 1/n, n)) and, with use_dynamic_shifting, mu from the request's
        image token count (calculate_shift)."""
        options: dict = {"sigmas": "linspace"}
        if sampling.uses_dynamic_shifting(self.scheduler_config):
            h, w = self.grid(params.height, params.width)
            options["mu"] = sampling.flow_shift_mu((h // 2) * (w // 2), self.scheduler_config)
        return options

    def noise_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        return (1, self.latent_channels, *self.grid(height, width))

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return pack_latents(latents)

    def unpack_latents(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return unpack_latents(latents, *self.grid(*size))

    def inpaint_channels(self, mask: torch.Tensor, masked_latents: torch.Tensor) -> torch.Tensor:
        """FluxFillPipeline.prepare_mask_latents: the masked image's latents packed, then the full-size mask
        (1, 1, H, W) folded into vae_scale_factor^2 channels per latent pixel and packed; joined per token."""
        h, w = masked_latents.shape[-2:]
        v = self.vae_scale_factor
        folded = mask[:, 0].view(1, h, v, w, v).permute(0, 2, 4, 1, 3).reshape(1, v * v, h, w)
        return torch.cat([pack_latents(masked_latents), pack_latents(folded.to(masked_latents.dtype))], dim=-1)

    # --- denoiser and decoder ----------------------------------------------------------------------------------
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, conditioning: dict,
                cache: list | None = None) -> torch.Tensor:
        """One transformer forward over the rows (one size bucket: the rows share their image ids)."""
        kwargs = dict(conditioning)
        img_ids = kwargs.pop("img_ids")
        if not bool((img_ids == img_ids[:1]).all()):
            raise ValueError("flux denoise: the rows of one forward must share an image size (one size bucket)")
        text_len = kwargs["encoder_hidden_states"].shape[1]
        # FluxPipeline: text_ids = zeros(T, 3) in the text encoder's dtype; timestep / 1000 in the latents' dtype.
        kwargs["txt_ids"] = torch.zeros(text_len, 3, device=sample.device, dtype=self.dtype)
        timestep = timestep.to(sample.dtype) / 1000
        with torch.no_grad():
            if cache is not None:
                return self.networks.denoise_cached(sample, timestep, cache, img_ids=img_ids[0], **kwargs)
            return self.networks.denoise(sample, timestep, img_ids=img_ids[0], **kwargs)

    @torch.no_grad()
    def image_latents(self, pixels: torch.Tensor, generator) -> torch.Tensor:
        """FluxImg2ImgPipeline._encode_vae_image: the images sampled from the VAE, shifted and scaled (unpacked:
        the noise is mixed in before packing, as the pipeline does)."""
        return self.networks.encode_image(pixels, generator).to(self.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        latents = self.unpack_latents(latents, size)
        latents = latents / self.vae_scaling_factor + self.vae_shift_factor
        return to_pil(self.networks.decode(latents.to(self.dtype)))


def fill_transformer(in_channels: int, latent_channels: int, vae_scale: int) -> bool:
    """Whether a transformer with `in_channels` is a Fill one (packed latents, packed masked-image latents and the
    packed mask: 4C + 4C + 4 * vae_scale^2), or plain (4C); anything else is an error naming both."""
    plain, fill = 4 * latent_channels, 8 * latent_channels + 4 * vae_scale**2
    if in_channels not in (plain, fill):
        raise ValueError(f"a Flux transformer with {in_channels} input channels; allowed: {plain} (text to image) or "
                         f"{fill} (Fill: inpainting) for {latent_channels} latent channels")
    return in_channels == fill


def flux_model_info(name: str, vae_scale: int, scheduler_config: dict, defaults: dict, *,
                    guidance_embeds: bool, fill: bool = False) -> ModelInfo:
    """Sizes: multiples of 2 * vae_scale (FluxPipeline's check: the latents tile into 2x2 patches); default
    128 * vae_scale (its default, 1024 for Flux.1); a quarter to twice that unless stepserve.json narrows them.
    Samplers: flow_euler, and DPM-Solver++(2M) in flow mode when the schedule shifts per resolution (FluxPipeline
    hands such a scheduler `mu`, which DPMSolverMultistepScheduler accepts only with use_dynamic_shifting)."""
    multiple = 2 * vae_scale
    default_size = DEFAULT_SAMPLE_SIZE * vae_scale
    samplers = ("flow_euler", "dpmpp_2m") if sampling.uses_dynamic_shifting(scheduler_config) else ("flow_euler",)
    return serving_info(name, defaults, size_multiple=multiple, default_size=default_size,
                        min_size=max(multiple, default_size // 4), max_size=default_size * 2,
                        default_sampler="flow_euler", default_steps=DEFAULT_STEPS,
                        default_guidance_scale=FILL_GUIDANCE if fill else DEFAULT_GUIDANCE, samplers=samplers,
                        family="flux",
                        negative_prompt=False, guidance="embedded")
