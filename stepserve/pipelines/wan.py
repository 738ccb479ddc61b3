"""Wan 2.1 / 2.2 text to video (diffusers `WanPipeline`): a `WanTransformer3DModel` (a DiT over (1, 2, 2) patches
of video latents with 3-axis RoPE), a UMT5 text encoder and `AutoencoderKLWan`, a causal video VAE whose latents
are 8x smaller in height and width and 4x shorter in time. Wan 2.2 (A14B) adds a second transformer, the
low-noise expert, that takes the steps whose timestep is below `boundary_ratio` x num_train_timesteps. Loaded from a
local folder; nothing is downloaded.

Every rule below is diffusers 0.42's `WanPipeline`, so that a served video equals the pipeline's:
- text (`_get_t5_prompt_embeds`): the prompt cleaned (`prompt_clean`: HTML entities, whitespace), tokenized to
  `max_sequence_length` (512) with a mask; the encoder's last hidden states cut to the prompt's tokens and padded
  back with zeros to 512, so every prompt has the same shape and rows batch without a mask.
- guidance: classifier-free when guidance_scale > 1, against the negative prompt (empty when none is given). Wan
  2.2's `guidance_scale_2` is not a request field: both experts use guidance_scale (the pipeline's default).
- latents: unit normal noise drawn in float32, (1, C, (F - 1) / 4 + 1, H / 8, W / 8); the transformer gets the
  scheduler's timestep as it is. Requests share a forward only within one (frames, height, width) bucket: the
  transformer's attention spans every token of a video and takes no mask, so padding would change the answer.
- timesteps: `set_timesteps(num_inference_steps)` with no sigmas. Wan ships `UniPCMultistepScheduler` in flow mode,
  which stepserve does not implement: it serves `dpmpp_2m` (DPM-Solver++(2M) with the same flow sigmas and
  flow_shift, the default) and `flow_euler` (FlowMatchEulerDiscreteScheduler with shift = flow_shift).
- decode: `latents / (1 / latents_std) + latents_mean` per channel, the VAE over the whole video, frames rounded as
  the video processor does. A preview decodes the first latent frame only (the VAE is causal: it is the first
  frame of the video).
A one-frame request is an image: one latent frame, one decoded frame (what WanPipeline gives for num_frames=1).
"""

from __future__ import annotations

import os

import torch
from PIL import Image

from ..request.buckets import bucket_frames, bucket_size
from ..request.types import ModelInfo, SamplingParams
from .family import Conditioning, FamilyAdapter
from .vae import to_pil
from .folder import PipelineFolder, serving_info
from .offload import Offload
from .weights import Weights

PIPELINE_CLASSES = ("WanPipeline",)
MAX_SEQUENCE_LENGTH = 512  # __call__'s max_sequence_length default
DEFAULT_HEIGHT, DEFAULT_WIDTH = 480, 832  # __call__'s defaults
DEFAULT_FRAMES = 81
DEFAULT_FPS = 16  # Wan 2.1 and 2.2 A14B videos are 16 frames per second
DEFAULT_STEPS = 50
DEFAULT_GUIDANCE = 5.0
MIN_SIZE, MAX_SIZE = 256, 1280  # 720p (1280x720) is Wan's largest trained size


def flow_scheduler_config(config: dict) -> dict:
    """The FlowMatchEulerDiscreteScheduler config stepserve's flow samplers read (flow_euler as it is; dpmpp_2m
    through sampling.flow_dpmpp_config, use_flow_sigmas with flow_shift = shift): from Wan's UniPC (or DPM-Solver)
    config in flow mode its flow_shift; a FlowMatch config is kept. Anything else is refused."""
    name = str(config.get("_class_name", ""))
    if name.startswith("FlowMatch"):
        return dict(config)
    if not config.get("use_flow_sigmas") or config.get("prediction_type") != "flow_prediction":
        raise ValueError(f"scheduler: {name or 'the scheduler'} without use_flow_sigmas and flow_prediction is not "
                         "a Wan flow schedule; allowed: UniPC/DPM-Solver in flow mode, or FlowMatchEulerDiscrete")
    return {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": config["num_train_timesteps"],
            "shift": float(config.get("flow_shift", 1.0)), "use_dynamic_shifting": False}


class WanTorchNetworks:
    """The text encoder, transformer(s) and VAE as torch modules. In `denoise` every tensor is batched on dim 0.
    With a low-noise expert (`transformer_2`), rows at timesteps below `boundary` run on it, the others on
    `transformer`; `whole_batch_experts` (the deterministic mode) runs each expert a step needs over all the rows,
    so no forward's shape depends on how the rows split."""

    def __init__(self, text_encoder, transformer, vae, transformer_2=None, boundary: float | None = None) -> None:
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.vae = vae
        self.boundary = boundary
        self.whole_batch_experts = False

    @torch.no_grad()
    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(input_ids, attention_mask).last_hidden_state

    @torch.no_grad()
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, *, encoder_hidden_states: torch.Tensor
                ) -> torch.Tensor:
        def run(transformer, rows=None):
            if rows is None:
                return transformer(hidden_states=sample, timestep=timestep,
                                   encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]
            return transformer(hidden_states=sample[rows], timestep=timestep[rows],
                               encoder_hidden_states=encoder_hidden_states[rows], return_dict=False)[0]

        if self.transformer_2 is None:
            return run(self.transformer)
        high = timestep >= self.boundary  # WanPipeline: t >= boundary_timestep is the high-noise expert's
        if bool(high.all()):
            return run(self.transformer)
        if not bool(high.any()):
            return run(self.transformer_2)
        if self.whole_batch_experts:
            return torch.where(high.view(-1, *[1] * (sample.dim() - 1)), run(self.transformer),
                               run(self.transformer_2))
        out = torch.empty_like(sample)
        out[high] = run(self.transformer, high).to(out.dtype)
        out[~high] = run(self.transformer_2, ~high).to(out.dtype)
        return out

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, latent frames, h, w) de-normalised latents -> (B, 3, frames, H, W) videos in [-1, 1]."""
        return self.vae.decode(latents, return_dict=False)[0]


class WanAdapter(FamilyAdapter):
    """A loaded Wan pipeline: the tokenizer, the networks (torch), configs."""

    family = "wan"
    torch_networks = WanTorchNetworks
    prompt_cache_size = 64  # a real prompt is 512 x 4096 values

    def __init__(self, tokenizer, networks: WanTorchNetworks, *, latents_mean: list[float],
                 latents_std: list[float], temporal_scale: int, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                 **common) -> None:
        """`common`: FamilyAdapter's keywords (scheduler_config (a flow config: flow_scheduler_config), info,
        latent_channels, vae_scale_factor (spatial), device, dtype); `temporal_scale`: frames per latent frame."""
        super().__init__(networks, **common)
        self.tokenizer = tokenizer
        shape = (1, len(latents_mean), 1, 1, 1)
        self.latents_mean = torch.tensor(latents_mean).view(shape).to(self.device, self.dtype)
        self.latents_inv_std = 1.0 / torch.tensor(latents_std).view(shape).to(self.device, self.dtype)
        self.temporal_scale = temporal_scale
        self.max_sequence_length = max_sequence_length

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike, device: str = "cpu",
                        dtype: torch.dtype = torch.float32, weights: Weights | None = None) -> "WanAdapter":
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import AutoTokenizer, UMT5EncoderModel

        folder = PipelineFolder.open(model, PIPELINE_CLASSES, weights=weights)
        if folder.index.get("expand_timesteps"):
            raise ValueError(f"{folder.name}: Wan 2.2 TI2V (expand_timesteps: per-token timesteps) is not served; "
                             "allowed: Wan 2.1 and Wan 2.2 A14B text-to-video folders")
        if (folder.index.get("transformer") or [None])[0] is None:
            raise ValueError(f"{folder.name}: a WanPipeline folder without 'transformer' is not served; allowed: "
                             "'transformer', with 'transformer_2' and boundary_ratio for Wan 2.2")
        parts = dict(tokenizer=AutoTokenizer, text_encoder=UMT5EncoderModel, transformer=WanTransformer3DModel,
                     vae=AutoencoderKLWan)
        boundary_ratio = folder.index.get("boundary_ratio")
        two = (folder.index.get("transformer_2") or [None])[0] is not None
        if two != (boundary_ratio is not None):
            raise ValueError(f"{folder.name}: 'transformer_2' and boundary_ratio go together (Wan 2.2); got "
                             f"transformer_2 {'present' if two else 'absent'}, boundary_ratio {boundary_ratio!r}")
        if two:
            parts["transformer_2"] = WanTransformer3DModel
        tokenizer, text_encoder, transformer, vae, *second = folder.load(dtype, **parts)
        place = Offload(folder.weights.offload, device).place
        text_encoder, transformer, vae = place(text_encoder).eval(), place(transformer, True).eval(), place(vae).eval()
        second = [place(m, denoiser=True).eval() for m in second]
        shipped = folder.scheduler_config()
        train_steps = int(shipped.get("num_train_timesteps", 1000))
        scheduler_config = flow_scheduler_config(shipped)
        # the sampler nearest what the folder ships: Euler for a FlowMatch scheduler, else DPM-Solver++ (UniPC's
        # flow sigmas)
        default_sampler = "flow_euler" if str(shipped.get("_class_name", "")).startswith("FlowMatch") else "dpmpp_2m"
        defaults = folder.serving_defaults()
        spatial = int(vae.config.scale_factor_spatial)
        networks = WanTorchNetworks(text_encoder, transformer, vae, *second,
                                    boundary=None if not two else float(boundary_ratio) * train_steps)
        info = wan_model_info(folder.name, spatial * transformer.config.patch_size[1], default_sampler, defaults,
                              int(vae.config.scale_factor_temporal))
        return cls(tokenizer, networks, scheduler_config=scheduler_config, info=info,
                   latent_channels=transformer.config.in_channels, vae_scale_factor=spatial,
                   latents_mean=list(vae.config.latents_mean), latents_std=list(vae.config.latents_std),
                   temporal_scale=int(vae.config.scale_factor_temporal),
                   max_sequence_length=int(defaults.get("max_sequence_length", MAX_SEQUENCE_LENGTH)),
                   device=device, dtype=dtype)

    # --- text --------------------------------------------------------------------------------------------------
    def _encode_missing(self, prompts: list[str]) -> list[torch.Tensor]:
        """(max_sequence_length, D) embeddings per prompt, each encoded alone (as the pipeline encodes one request):
        the prompt's tokens, then zeros."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        out = []
        for prompt in prompts:
            tokens = self.tokenizer([prompt_clean(prompt)], padding="max_length", max_length=self.max_sequence_length,
                                    truncation=True, add_special_tokens=True, return_attention_mask=True,
                                    return_tensors="pt")
            mask = tokens.attention_mask.to(self.device)
            hidden = self.networks.encode_text(tokens.input_ids.to(self.device), mask)[0].to(self.dtype)
            length = int(mask[0].gt(0).sum())
            out.append(torch.cat([hidden[:length], hidden.new_zeros(hidden.shape[0] - length, hidden.shape[1])]))
        return out

    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        """The prompt's row, and the negative prompt's (empty when none) when guidance_scale > 1."""
        guided = [p.guidance_scale > 1 for p in params]
        texts = [p.prompt for p in params] + [p.negative_prompt or "" for p, g in zip(params, guided) if g]
        embeds = iter(self.encode_prompts(texts))
        rows = [{"encoder_hidden_states": next(embeds)[None]} for _ in params]
        return [Conditioning(row, {"encoder_hidden_states": next(embeds)[None]} if g else None)
                for row, g in zip(rows, guided)]

    # --- latents -----------------------------------------------------------------------------------------------
    def latent_frames(self, frames: int) -> int:
        return (frames - 1) // self.temporal_scale + 1

    def initial_latents(self, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        """WanPipeline.prepare_latents: float32 noise (1, C, latent frames, H / 8, W / 8), then the model's dtype."""
        shape = (1, self.latent_channels, self.latent_frames(params.num_frames),
                 int(params.height) // self.vae_scale_factor, int(params.width) // self.vae_scale_factor)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        return noise.to(self.device, self.dtype)

    # --- denoiser and decoder ----------------------------------------------------------------------------------
    def denoise(self, sample: torch.Tensor, timestep: torch.Tensor, conditioning: dict,
                cache: list | None = None) -> torch.Tensor:
        """One forward over the rows of one (frames, height, width) bucket (each expert's rows, on Wan 2.2)."""
        if cache is not None:
            raise ValueError("wan denoise: step caching is not served for this family")
        with torch.no_grad():
            return self.networks.denoise(sample, timestep.to(torch.float32), **conditioning)

    def _videos(self, latents: torch.Tensor) -> torch.Tensor:
        return self.networks.decode(latents.to(self.dtype) / self.latents_inv_std + self.latents_mean)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, size: tuple[int, ...]) -> list[list[Image.Image]]:
        """Per request, its frames (bucket_frames(size) of them) as PIL images. One video at a time, as the
        pipeline decodes one request: a video's decode is large enough to gain nothing from a batch, its peak memory
        stays that of one video, and on CPU the VAE's 3D convolutions are not row-invariant across a batch (the
        deterministic mode's byte identity would not hold)."""
        out = []
        for i in range(latents.shape[0]):
            video = self._videos(latents[i : i + 1])
            if video.shape[2] != bucket_frames(size) or tuple(video.shape[-2:]) != bucket_size(size):
                raise RuntimeError(f"wan decode: the VAE made {tuple(video.shape[2:])} (frames, height, width) for "
                                   f"the bucket {size}")
            out.append(to_pil(video[0].transpose(0, 1)))
        return out

    @torch.no_grad()
    def preview(self, latents: torch.Tensor, size: tuple[int, ...]) -> Image.Image:
        """The first frame: the first latent frame decoded alone (the causal VAE decodes it the same either way)."""
        return to_pil(self._videos(latents[:, :, :1])[:, :, 0])[0]


def wan_model_info(name: str, size_multiple: int, default_sampler: str, defaults: dict,
                   frame_step: int) -> ModelInfo:
    """Sizes: multiples of the VAE's spatial scale times the patch (16), 256 to 1280 (default 832x480) unless
    stepserve.json narrows them; frames 1 + a multiple of the VAE's temporal scale (4), up to 81 (default 81 on the
    videos endpoint; 1, an image, elsewhere). Samplers: dpmpp_2m (Wan's flow sigmas) and flow_euler, the default
    `default_sampler`. guidance_scale: CFG (5.0) against the negative prompt."""
    max_frames = int(defaults.get("max_frames", DEFAULT_FRAMES))
    default_frames = int(defaults.get("default_frames", min(DEFAULT_FRAMES, max_frames)))
    for key, value in (("max_frames", max_frames), ("default_frames", default_frames)):
        if value < 1 or (value - 1) % frame_step or default_frames > max_frames:
            raise ValueError(f"stepserve.json: {key} {value} must be 1 + a multiple of {frame_step}, and "
                             f"default_frames ({default_frames}) at most max_frames ({max_frames})")
    fps = defaults.get("fps", DEFAULT_FPS)
    if not isinstance(fps, int) or isinstance(fps, bool) or not 1 <= fps <= 120:
        raise ValueError(f"stepserve.json: fps must be an integer from 1 to 120, got {fps!r}")
    return serving_info(name, {"height": DEFAULT_HEIGHT, "width": DEFAULT_WIDTH, **defaults},
                        size_multiple=size_multiple, default_size=DEFAULT_HEIGHT, min_size=MIN_SIZE,
                        max_size=MAX_SIZE, default_sampler=default_sampler, default_steps=DEFAULT_STEPS,
                        default_guidance_scale=DEFAULT_GUIDANCE, samplers=("dpmpp_2m", "flow_euler"), family="wan",
                        negative_prompt=True, guidance="cfg", max_frames=max_frames, frame_step=frame_step,
                        default_frames=default_frames, default_fps=fps)
