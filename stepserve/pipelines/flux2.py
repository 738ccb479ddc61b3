"""Flux.2 (diffusers `Flux2KleinPipeline` and `Flux2Pipeline`): a `Flux2Transformer2DModel` (double- and
single-stream MMDiT blocks with 4-axis RoPE), a text encoder whose intermediate hidden states are stacked into the
token embeddings (no pooled output), and `AutoencoderKLFlux2`, whose latents are patchified 2x2 and normalised by
the VAE's batch-norm statistics. Loaded from a local folder; nothing is downloaded.

This module is Flux.2 [klein] (`Flux2Adapter`) and everything both variants share; flux2_dev.py is [dev]
(`Flux2DevAdapter`: a Mistral-3 encoder with a system message, guidance embedded in the transformer). Every rule
below is diffusers 0.42's pipelines, so that a served image equals the pipeline's:
- text (klein, `_get_qwen3_prompt_embeds`): the prompt as one user message through the tokenizer's chat template
  (`add_generation_prompt=True, enable_thinking=False`), padded to `max_sequence_length` (512) with a mask; the
  hidden states of layers 9, 18 and 27 (`text_encoder_out_layers`) stacked per token, (L, 3 x width). No pooled
  input, no negative prompt: classifier-free guidance runs with the empty prompt as the unconditional one, when
  guidance_scale > 1 and the model is not step-distilled (`is_distilled` in model_index.json; distilled: no
  guidance at all).
- latents: unit normal noise drawn already patchified, (1, 4C, h/2, w/2) with h, w = 2 * (H // (2 * vae_scale)),
  then flattened to tokens (1, h/2 * w/2, 4C). Position ids (t, h, w, l): image tokens (0, row, column, 0), text
  tokens (0, 0, 0, index), shared by the rows of a size bucket.
- timesteps: `set_timesteps(sigmas=np.linspace(1, 1/n, n), mu=compute_empirical_mu(image tokens, n))`: the shift
  depends on the image size and on the step count.
- the transformer gets `timestep / 1000` in the latents' dtype (and, on [dev], the guidance value per row);
  decode: tokens back to (4C, h/2, w/2), `x * sqrt(bn.running_var + eps) + bn.running_mean`, unpatchify, the VAE.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch
from PIL import Image

from .. import sampling
from ..request.types import ModelInfo, SamplingParams
from .family import Conditioning, FamilyAdapter
from .vae import to_pil, vae_scale_factor_of
from .flux import check_text_split, latent_grid
from .folder import PipelineFolder, serving_info
from .offload import Offload
from .weights import Weights

PIPELINE_CLASSES = ("Flux2KleinPipeline",)
MAX_SEQUENCE_LENGTH = 512  # __call__'s max_sequence_length default (both pipelines)
TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline.__call__'s text_encoder_out_layers default
DEFAULT_SAMPLE_SIZE = 128  # default height/width = 128 * vae_scale_factor
DEFAULT_STEPS = 50
DEFAULT_GUIDANCE = 4.0


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The schedule shift of Flux.2 (Black Forest Labs' flux2 text_encoder.py, as diffusers'
    compute_empirical_mu): a line in the image token count, interpolated in the step count between its 10-step
    and 200-step fits (only the 200-step fit above 4300 tokens). Same float operations, same result."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


class Flux2TorchNetworks:
    """The text encoder, transformer and VAE as torch modules. In `denoise` every tensor is batched on dim 0;
    `grid` (rows, columns of image tokens: the same for the rows of one size bucket) is a tuple, and the position
    ids are built from it and from the text length."""

    def __init__(self, text_encoder, transformer, vae) -> None:
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.vae = vae
        self._ids: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (grid, text length, device) -> ids

    def _position_ids(self, grid: tuple[int, int], text_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(image ids (0, row, column, 0), text ids (0, 0, 0, index)), each (1, tokens, 4), built once per shape
        and device, not per step. The leading 1 is what diffusers' sequence-parallel plan for this transformer
        splits (ids of 3 dimensions, on dim 1); its forward takes [0] of them either way."""
        key = (grid, text_len, str(device))
        if key not in self._ids:
            one = torch.arange(1)
            self._ids[key] = (torch.cartesian_prod(one, torch.arange(grid[0]), torch.arange(grid[1]), one)[None]
                              .to(device),
                              torch.cartesian_prod(one, one, one, torch.arange(text_len))[None].to(device))
        return self._ids[key]

    @torch.no_grad()
    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...]
                    ) -> torch.Tensor:
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                use_cache=False)
        stacked = torch.stack([out.hidden_states[k] for k in layers], dim=1)  # (B, layers, L, D)
        b, n, length, width = stacked.shape
        return stacked.permute(0, 2, 1, 3).reshape(b, length, n * width)

    @torch.no_grad()
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, *, encoder_hidden_states: torch.Tensor,
                grid: tuple[int, int], guidance: torch.Tensor | None = None) -> torch.Tensor:
        """`guidance`: (rows,) float32 values for a guidance-embedding transformer ([dev]); None on klein."""
        img_ids, txt_ids = self._position_ids(grid, encoder_hidden_states.shape[1], sample.device)
        return self.transformer(hidden_states=sample, timestep=timestep, guidance=guidance,
                                encoder_hidden_states=encoder_hidden_states, txt_ids=txt_ids, img_ids=img_ids,
                                return_dict=False)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents, return_dict=False)[0]


class Flux2Adapter(FamilyAdapter):
    """A loaded Flux.2 [klein] pipeline: the tokenizer, the networks (torch), configs. The base of Flux.2 [dev]'s
    adapter (flux2_dev.py), which changes what the class attributes and the methods marked "per variant" say."""

    family = "flux2"
    torch_networks = Flux2TorchNetworks
    lora_loader = ("diffusers.loaders.lora_pipeline:Flux2LoraLoaderMixin", "transformer")  # stepserve/lora
    prompt_cache_size = 64  # a real prompt is 512 x 7680 values
    # per variant: the diffusers pipeline class, its default text_encoder_out_layers, how guidance_scale acts
    pipeline_classes: ClassVar[tuple[str, ...]] = PIPELINE_CLASSES
    default_text_layers: ClassVar[tuple[int, ...]] = TEXT_LAYERS
    guidance_mode: ClassVar[str] = "cfg"

    def __init__(self, tokenizer, networks: Flux2TorchNetworks, *, bn_mean: torch.Tensor, bn_std: torch.Tensor,
                 distilled: bool = False, text_layers: tuple[int, ...] | None = None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, **common) -> None:
        """`common`: FamilyAdapter's keywords (scheduler_config, info, latent_channels (the patchified channels the
        transformer takes), vae_scale_factor, device, dtype); `bn_mean` / `bn_std`: the VAE's latent statistics;
        `distilled`: a step-distilled klein (no guidance); `text_layers`: default the variant's."""
        super().__init__(networks, **common)
        self.tokenizer = tokenizer
        self.distilled = distilled
        self.bn_mean = bn_mean
        self.bn_std = bn_std
        self.text_layers = tuple(text_layers or self.default_text_layers)
        self.max_sequence_length = max_sequence_length

    def check_sequence_degree(self, n: int) -> None:
        """diffusers' Flux.2 plan splits the text tokens with the image tokens: all max_sequence_length of them."""
        check_text_split(self.info.name, self.max_sequence_length, n)

    # --- per variant -------------------------------------------------------------------------------------------
    @classmethod
    def text_parts(cls, folder: PipelineFolder) -> dict[str, type]:
        """The classes the folder's `tokenizer` and `text_encoder` load with."""
        from transformers import AutoTokenizer, Qwen3ForCausalLM

        return {"tokenizer": AutoTokenizer, "text_encoder": Qwen3ForCausalLM}

    @classmethod
    def check_transformer(cls, name: str, config) -> None:
        """Klein's transformer takes no guidance value; one that embeds it is [dev]'s, whose pipeline feeds it."""
        if config.guidance_embeds:
            raise ValueError(f"{name}: a guidance-embedding Flux.2 transformer in a Flux2KleinPipeline folder; "
                             "allowed: guidance_embeds false (klein), or a Flux2Pipeline folder (dev)")

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), (1, max_sequence_length): Flux2KleinPipeline's chat formatting."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=False)
        tokens = self.tokenizer(text, return_tensors="pt", padding="max_length", truncation=True,
                                max_length=self.max_sequence_length)
        return tokens["input_ids"], tokens["attention_mask"]

    # --- loading -----------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights: Weights | None = None) -> "Flux2Adapter":
        from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

        folder = PipelineFolder.open(model, cls.pipeline_classes, weights=weights)
        device = torch.device(device)
        tokenizer, text_encoder, transformer, vae = folder.load(
            dtype, **cls.text_parts(folder), transformer=Flux2Transformer2DModel, vae=AutoencoderKLFlux2)
        cls.check_transformer(folder.name, transformer.config)
        place = Offload(folder.weights.offload, device).place
        text_encoder, transformer, vae = place(text_encoder).eval(), place(transformer, True).eval(), place(vae).eval()
        scheduler_config = folder.scheduler_config()
        defaults = folder.serving_defaults()
        vae_scale = vae_scale_factor_of(vae.config)
        # both pipelines' __call__: latents * sqrt(running_var + eps) + running_mean, (1, 4C, 1, 1)
        bn_mean = vae.bn.running_mean.view(1, -1, 1, 1).to(device, dtype)
        bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(device, dtype)
        layers = tuple(int(k) for k in defaults.get("text_encoder_out_layers", cls.default_text_layers))
        # a missing layer would fail at the first prompt with an IndexError; say so at load, with what exists
        depth = text_encoder.config.get_text_config().num_hidden_layers
        if not layers or not all(0 <= k <= depth for k in layers):
            raise ValueError(f"{folder.name}: text_encoder_out_layers {list(layers)}: the text encoder has {depth} "
                             f"layers; allowed: one or more of 0..{depth} (0: the token embeddings)")
        return cls(tokenizer, Flux2TorchNetworks(text_encoder, transformer, vae), scheduler_config=scheduler_config,
                   info=flux2_model_info(folder.name, vae_scale, scheduler_config, defaults, cls.guidance_mode),
                   latent_channels=transformer.config.in_channels, vae_scale_factor=vae_scale,
                   distilled=bool(folder.index.get("is_distilled", False)), bn_mean=bn_mean, bn_std=bn_std,
                   text_layers=layers,
                   max_sequence_length=int(defaults.get("max_sequence_length", MAX_SEQUENCE_LENGTH)),
                   device=device, dtype=dtype)

    # --- text --------------------------------------------------------------------------------------------------
    def _encode_missing(self, prompts: list[str]) -> list[torch.Tensor]:
        """(L, 3 x width) embeddings per prompt, each prompt encoded alone (as the pipeline encodes one request)."""
        out = []
        for prompt in prompts:
            input_ids, attention_mask = self.tokenize(prompt)
            hidden = self.networks.encode_text(input_ids.to(self.device), attention_mask.to(self.device),
                                               self.text_layers)
            out.append(hidden[0].to(self.dtype))
        return out

    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        """The prompt's row, and the empty prompt's when guidance_scale > 1 on a model that is not distilled."""
        out = []
        guided = [p.guidance_scale > 1 and not self.distilled for p in params]
        embeds = self.encode_prompts([p.prompt for p in params] + ([""] if any(guided) else []))
        empty = embeds[-1] if any(guided) else None
        for p, e, g in zip(params, embeds, guided):
            grid = self.token_grid(p)
            out.append(Conditioning({"encoder_hidden_states": e[None], "grid": grid},
                                    {"encoder_hidden_states": empty[None], "grid": grid} if g else None))
        return out

    # --- schedule and latents ----------------------------------------------------------------------------------
    def grid(self, height: int, width: int) -> tuple[int, int]:
        return latent_grid(height, width, self.vae_scale_factor)

    def token_grid(self, params: SamplingParams) -> torch.Tensor:
        """(1, 2): the rows and columns of the request's image tokens (a conditioning row: denoise builds the
        position ids from it, once per size bucket)."""
        h, w = self.grid(params.height, params.width)
        return torch.tensor([[h // 2, w // 2]], dtype=torch.int64)

    def schedule_options(self, params: SamplingParams) -> dict:
        """The pipeline's sigmas (np.linspace(1, 1/n, n)) and, with use_dynamic_shifting, mu from the request's
        image token count and step count (empirical_mu)."""
        options: dict = {"sigmas": "linspace"}
        if sampling.uses_dynamic_shifting(self.scheduler_config):
            h, w = self.grid(params.height, params.width)
            options["mu"] = empirical_mu((h // 2) * (w // 2), params.num_inference_steps)
        return options

    def noise_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        h, w = self.grid(height, width)
        return (1, self.latent_channels, h // 2, w // 2)

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, 4C, h/2, w/2) -> (B, h/2 * w/2, 4C): Flux2KleinPipeline._pack_latents."""
        b, c, h, w = latents.shape
        return latents.reshape(b, c, h * w).permute(0, 2, 1)

    def unpack_latents(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """(B, h/2 * w/2, 4C) -> (B, 4C, h/2, w/2): the token grid the ids describe (row-major)."""
        h, w = self.grid(*size)
        b, _, c = latents.shape
        return latents.permute(0, 2, 1).reshape(b, c, h // 2, w // 2)

    # --- denoiser and decoder ----------------------------------------------------------------------------------
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, conditioning: dict,
                cache: list | None = None) -> torch.Tensor:
        """One transformer forward over the rows (one size bucket: the rows share their position ids)."""
        if cache is not None:
            raise ValueError("flux2 denoise: step caching is not served for this family")
        kwargs = dict(conditioning)
        grid = kwargs.pop("grid")
        if not bool((grid == grid[:1]).all()):
            raise ValueError("flux2 denoise: the rows of one forward must share an image size (one size bucket)")
        with torch.no_grad():
            return self.networks.denoise(sample, timestep.to(sample.dtype) / 1000,
                                         grid=tuple(int(v) for v in grid[0].tolist()), **kwargs)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        x = self.unpack_latents(latents, size).to(self.dtype) * self.bn_std + self.bn_mean
        b, c, h, w = x.shape  # unpatchify: Flux2KleinPipeline._unpatchify_latents
        x = x.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
        return to_pil(self.networks.decode(x))


def flux2_model_info(name: str, vae_scale: int, scheduler_config: dict, defaults: dict,
                     guidance: str = "cfg") -> ModelInfo:
    """Sizes: multiples of 2 * vae_scale (2x2 patches of latents); default 128 * vae_scale (1024), a quarter to
    twice that unless stepserve.json narrows them. Samplers: flow_euler, and DPM-Solver++(2M) in flow mode when the
    schedule shifts (the pipeline hands the scheduler `mu`). guidance_scale (default 4.0 in both pipelines):
    "cfg" (klein: against the empty prompt) or "embedded" (dev: the transformer's guidance input)."""
    multiple = 2 * vae_scale
    default_size = DEFAULT_SAMPLE_SIZE * vae_scale
    samplers = ("flow_euler", "dpmpp_2m") if sampling.uses_dynamic_shifting(scheduler_config) else ("flow_euler",)
    return serving_info(name, defaults, size_multiple=multiple, default_size=default_size,
                        min_size=max(multiple, default_size // 4), max_size=default_size * 2,
                        default_sampler="flow_euler", default_steps=DEFAULT_STEPS,
                        default_guidance_scale=DEFAULT_GUIDANCE, samplers=samplers, family="flux2",
                        negative_prompt=False, guidance=guidance)
