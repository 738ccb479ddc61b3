"""Qwen-Image (diffusers `QwenImagePipeline`): a `QwenImageTransformer2DModel` (MMDiT blocks with 3-axis RoPE), a
Qwen2.5-VL text encoder and a video VAE (`AutoencoderKLQwenImage`) run on one frame, sampled by flow matching.
Loaded from a local folder; nothing is downloaded.

Every rule below is diffusers 0.42's `QwenImagePipeline`, so that a served image equals the pipeline's:
- text (`_get_qwen_prompt_embeds`): the prompt in the pipeline's chat template, tokenized up to 1024 + 34 tokens;
  the encoder's last hidden states with the template's first 34 tokens dropped, then cut to `max_sequence_length`
  (512). Prompts have their own lengths: each is encoded alone (as the pipeline encodes one request), and the rows
  of one step are padded to the longest with an attention mask (`collate`), as the pipeline pads a batch of
  prompts. A step whose rows all have one length passes no mask, as the pipeline does for one prompt.
- guidance: "true CFG" only when the request has a negative prompt and guidance_scale (the pipeline's
  `true_cfg_scale`, default 4.0) > 1; then the mixed prediction is rescaled to the norm of the conditional one,
  per token (`combine_guidance`). Without a negative prompt there is no unconditional row and guidance_scale is
  not used. An empty negative prompt means none (send " " for an empty unconditional prompt, as diffusers asks).
- latents: noise (1, 1, C, h, w) with h, w = 2 * (H // (2 * vae_scale)) (drawn as (1, C, h, w): the same numbers),
  packed into 2x2 patches as Flux's; `img_shapes` (1, h/2, w/2) per row; the transformer gets `timestep / 1000`.
- timesteps: `set_timesteps(sigmas=np.linspace(1, 1/n, n), mu=calculate_shift(image tokens))`, the scheduler's
  own `shift_terminal` and time shift applied by it (so only flow_euler: DPM-Solver's flow mode has no terminal
  shift).
- decode: unpack, `latents / (1 / latents_std) + latents_mean` per channel, the VAE on one frame, drop the frame.
"""

from __future__ import annotations

import os

import torch
from PIL import Image

from .. import sampling
from ..request.types import ModelInfo, SamplingParams
from ..util.shards import sequence_degree, shard_residuals
from .control_mmdit import QwenImageControls
from .family import Conditioning, FamilyAdapter, stack_rows
from .vae import to_pil
from .flux import latent_grid, pack_latents, unpack_latents
from .folder import PipelineFolder, serving_info
from .offload import Offload
from .weights import Weights

PIPELINE_CLASSES = ("QwenImagePipeline",)
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")  # QwenImagePipeline.prompt_template_encode
DROP_TOKENS = 34  # prompt_template_encode_start_idx: the template's tokens before the prompt
TOKENIZER_MAX_LENGTH = 1024  # tokenizer_max_length
MAX_SEQUENCE_LENGTH = 512  # __call__'s max_sequence_length default (at most 1024)
DEFAULT_SAMPLE_SIZE = 128  # default height/width = 128 * vae_scale_factor (1024 for Qwen-Image)
DEFAULT_STEPS = 50
DEFAULT_TRUE_CFG = 4.0


class QwenImageTorchNetworks:
    """The text encoder, transformer and VAE as torch modules. In `denoise` every tensor is batched on dim 0;
    `img_shape` (frames, rows, columns of the patch grid: the same for the rows of one size bucket) is a tuple."""

    def __init__(self, text_encoder, transformer, vae) -> None:
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.vae = vae

    @torch.no_grad()
    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return out.hidden_states[-1]

    @torch.no_grad()
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, *, encoder_hidden_states: torch.Tensor,
                img_shape: tuple[int, int, int], encoder_hidden_states_mask: torch.Tensor | None = None,
                **controls) -> torch.Tensor:
        """`controls`: ControlNet outputs (controlnet_block_samples), when some row has a control; whole, cut here
        to the tokens this rank's blocks run when the transformer is split (--ulysses-degree)."""
        controls = shard_residuals(controls, self.transformer)
        return self.transformer(hidden_states=sample, timestep=timestep, encoder_hidden_states=encoder_hidden_states,
                                encoder_hidden_states_mask=encoder_hidden_states_mask,
                                img_shapes=[[img_shape]] * sample.shape[0], return_dict=False, **controls)[0]

    cache_policies = ("fbcache",)  # stepserve/caching (magcache's ratios are calibrated for Flux only)

    @torch.no_grad()
    def denoise_cached(self, sample: torch.Tensor, timestep: torch.Tensor, rows: list, *,
                       encoder_hidden_states: torch.Tensor, img_shape: tuple[int, int, int],
                       encoder_hidden_states_mask: torch.Tensor | None = None, **controls) -> torch.Tensor:
        """denoise, each row caching as `rows` says (stepserve/caching)."""
        from ..caching.qwenimage import qwenimage_forward

        return qwenimage_forward(self.transformer, sample, timestep, encoder_hidden_states=encoder_hidden_states,
                                 img_shapes=[[img_shape]] * sample.shape[0],
                                 encoder_hidden_states_mask=encoder_hidden_states_mask, rows=rows, **controls)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, 1, h, w) normalised latents -> (B, 3, H, W) images in [-1, 1] (the one frame)."""
        return self.vae.decode(latents, return_dict=False)[0][:, :, 0]


class QwenImageAdapter(QwenImageControls, FamilyAdapter):
    """A loaded Qwen-Image pipeline: the tokenizer, the networks (torch), configs."""

    family = "qwenimage"
    torch_networks = QwenImageTorchNetworks
    lora_loader = ("diffusers.loaders.lora_pipeline:QwenImageLoraLoaderMixin", "transformer")  # stepserve/lora
    prompt_cache_size = 64  # a real prompt is up to 512 x 3584 values

    def __init__(self, tokenizer, networks: QwenImageTorchNetworks, *, latents_mean: list[float],
                 latents_std: list[float], max_sequence_length: int = MAX_SEQUENCE_LENGTH, **common) -> None:
        """`common`: FamilyAdapter's keywords (scheduler_config, info, latent_channels, vae_scale_factor, device,
        dtype)."""
        if not 1 <= max_sequence_length <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"max_sequence_length must be in 1..{TOKENIZER_MAX_LENGTH} (QwenImagePipeline's "
                             f"bound); got {max_sequence_length!r}")
        super().__init__(networks, **common)
        self.tokenizer = tokenizer
        # QwenImagePipeline's decode: latents / (1 / latents_std) + latents_mean, per channel (1, C, 1, 1, 1)
        shape = (1, len(latents_mean), 1, 1, 1)
        self.latents_mean = torch.tensor(latents_mean).view(shape).to(self.device, self.dtype)
        self.latents_inv_std = 1.0 / torch.tensor(latents_std).view(shape).to(self.device, self.dtype)
        self.max_sequence_length = max_sequence_length
        # set by the deterministic mode (backends/fast_path.py): every step's text padded to this many tokens, so
        # that no forward's shape depends on the other rows' prompts
        self.fixed_text_length: int | None = None

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights: Weights | None = None) -> "QwenImageAdapter":
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        folder = PipelineFolder.open(model, PIPELINE_CLASSES, weights=weights)
        device = torch.device(device)
        tokenizer, text_encoder, transformer, vae = folder.load(
            dtype, tokenizer=AutoTokenizer, text_encoder=Qwen2_5_VLForConditionalGeneration,
            transformer=QwenImageTransformer2DModel, vae=AutoencoderKLQwenImage)
        if transformer.config.guidance_embeds:
            raise ValueError(f"{folder.name}: a guidance-distilled Qwen-Image transformer (guidance_embeds) is not "
                             "served; allowed: guidance_embeds false (true CFG with a negative prompt)")
        place = Offload(folder.weights.offload, device).place
        modules = [place(m, denoiser=m is transformer).eval() for m in (text_encoder, transformer, vae)]
        scheduler_config = folder.scheduler_config()
        defaults = folder.serving_defaults()
        vae_scale = 2 ** len(vae.config.temperal_downsample)  # QwenImagePipeline.vae_scale_factor
        info = qwenimage_model_info(folder.name, vae_scale, defaults)
        return cls(tokenizer, QwenImageTorchNetworks(*modules), scheduler_config=scheduler_config, info=info,
                   latent_channels=vae.config.z_dim, vae_scale_factor=vae_scale,
                   latents_mean=list(vae.config.latents_mean), latents_std=list(vae.config.latents_std),
                   max_sequence_length=int(defaults.get("max_sequence_length", MAX_SEQUENCE_LENGTH)),
                   device=device, dtype=dtype)

    # --- text --------------------------------------------------------------------------------------------------
    def _encode_missing(self, prompts: list[str]) -> list[torch.Tensor]:
        """(T, D) token embeddings per prompt, each prompt encoded alone (no padding: its own length)."""
        out = []
        for prompt in prompts:
            tokens = self.tokenizer([TEMPLATE.format(prompt)], max_length=TOKENIZER_MAX_LENGTH + DROP_TOKENS,
                                    padding=True, truncation=True, return_tensors="pt").to(self.device)
            hidden = self.networks.encode_text(tokens.input_ids, tokens.attention_mask)
            out.append(hidden[0][tokens.attention_mask[0].bool()][DROP_TOKENS:][: self.max_sequence_length]
                       .to(self.dtype))
        return out

    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        """The prompt's row, and the negative prompt's when the request has one and guidance_scale > 1."""
        guided = [bool(p.negative_prompt) and p.guidance_scale > 1 for p in params]
        texts = [p.prompt for p in params] + [p.negative_prompt for p, g in zip(params, guided) if g]
        embeds = iter(self.encode_prompts(texts))
        rows = [self._row(next(embeds), p) for p in params]
        return [Conditioning(row, self._row(next(embeds), p) if g else None)
                for row, p, g in zip(rows, params, guided)]

    def _row(self, embeds: torch.Tensor, p: SamplingParams) -> dict[str, torch.Tensor]:
        h, w = self.grid(p.height, p.width)
        return {"encoder_hidden_states": embeds[None],
                "img_shape": torch.tensor([[1, h // 2, w // 2]], dtype=torch.int64)}

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Pad the rows' text to the longest (or to fixed_text_length) with a mask; no mask when every row has
        the same length and no fixed length is set. With the transformer split over sequence ranks
        (--ulysses-degree: diffusers' plan splits the text tokens too, in equal pieces) the padding goes on to a
        multiple of their number: masked tokens that change no image token's attention."""
        lengths = [row["encoder_hidden_states"].shape[1] for row in rows]
        longest = max(lengths) if self.fixed_text_length is None else self.fixed_text_length
        n = sequence_degree(self.networks.transformer)
        longest = -(-longest // n) * n
        if self.fixed_text_length is None and min(lengths) == longest:
            return stack_rows(rows)
        padded, mask = [], torch.zeros(len(rows), longest, dtype=torch.int64, device=self.device)
        for i, row in enumerate(rows):
            text = row["encoder_hidden_states"]
            padded.append(torch.cat([text, text.new_zeros(1, longest - text.shape[1], text.shape[2])], dim=1))
            mask[i, : text.shape[1]] = 1
        batched = stack_rows([{k: v for k, v in row.items() if k != "encoder_hidden_states"} for row in rows])
        return {**batched, "encoder_hidden_states": torch.cat(padded), "encoder_hidden_states_mask": mask}

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """True CFG rescaled to the conditional prediction's norm per token (QwenImagePipeline.__call__)."""
        mixed = uncond + scale * (cond - uncond)
        return mixed * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(mixed, dim=-1, keepdim=True))

    # --- schedule and latents ----------------------------------------------------------------------------------
    def grid(self, height: int, width: int) -> tuple[int, int]:
        return latent_grid(height, width, self.vae_scale_factor)

    def schedule_options(self, params: SamplingParams) -> dict:
        """The pipeline's sigmas (np.linspace(1, 1/n, n)) and mu from the request's image token count."""
        h, w = self.grid(params.height, params.width)
        return {"sigmas": "linspace", "mu": sampling.flow_shift_mu((h // 2) * (w // 2), self.scheduler_config)}

    def noise_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        return (1, self.latent_channels, *self.grid(height, width))

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return pack_latents(latents)

    def unpack_latents(self, latents: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return unpack_latents(latents, *self.grid(*size))

    # --- denoiser and decoder ----------------------------------------------------------------------------------
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, conditioning: dict,
                cache: list | None = None) -> torch.Tensor:
        """One transformer forward over the rows (one size bucket: the rows share their patch grid)."""
        kwargs = dict(conditioning)
        shape = kwargs.pop("img_shape")
        if not bool((shape == shape[:1]).all()):
            raise ValueError("qwenimage denoise: the rows of one forward must share an image size (one size bucket)")
        img_shape = tuple(int(v) for v in shape[0].tolist())
        timestep = timestep.to(sample.dtype) / 1000
        with torch.no_grad():
            if cache is not None:
                return self.networks.denoise_cached(sample, timestep, cache, img_shape=img_shape, **kwargs)
            return self.networks.denoise(sample, timestep, img_shape=img_shape, **kwargs)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, size: tuple[int, int]) -> list[Image.Image]:
        latents = self.unpack_latents(latents, size)[:, :, None].to(self.dtype)
        return to_pil(self.networks.decode(latents / self.latents_inv_std + self.latents_mean))


def qwenimage_model_info(name: str, vae_scale: int, defaults: dict) -> ModelInfo:
    """Sizes: multiples of 2 * vae_scale (the latents tile into 2x2 patches); default 128 * vae_scale (1024 for
    Qwen-Image), a quarter to twice that unless stepserve.json narrows them. Sampler: flow_euler (the pipeline's
    scheduler; its shift_terminal has no DPM-Solver counterpart). guidance_scale is true_cfg_scale (4.0)."""
    multiple = 2 * vae_scale
    default_size = DEFAULT_SAMPLE_SIZE * vae_scale
    return serving_info(name, defaults, size_multiple=multiple, default_size=default_size,
                        min_size=max(multiple, default_size // 4), max_size=default_size * 2,
                        default_sampler="flow_euler", default_steps=DEFAULT_STEPS,
                        default_guidance_scale=DEFAULT_TRUE_CFG, samplers=("flow_euler",), family="qwenimage",
                        negative_prompt=True, guidance="cfg")
