"""The model-family adapter interface: what the executor needs from a pipeline, whatever its architecture.

How to add a family (SD 1/2 in diffusers_sd.py and SDXL in sdxl.py are worked examples):

1. Write `stepserve/pipelines/<family>.py` with a class that subclasses `FamilyAdapter`, sets `family` (a short
   name: "sdxl") and calls `FamilyAdapter.__init__` from its constructor with what every family keeps:
   - `networks` (the torch modules behind the batched calls below), `scheduler_config` (the folder's
     scheduler_config.json as a dict), `device` and `dtype` (set the class's `prompt_cache_size` lower when
     encoded prompts are large);
   - `info`: a `ModelInfo` (sizes, defaults, allowed samplers, and the family's request rules: `family`,
     `negative_prompt` (may a request set one), `guidance` ("cfg" or "embedded"); validation.py enforces them and
     names what is allowed). folder.serving_info builds one from the family's own defaults (size, sampler,
     steps, guidance; list only samplers its scheduler fits) and the folder's stepserve.json;
     diffusers_sd.model_info_for is the UNet/VAE families' use of it;
   - `latent_channels` and `vae_scale_factor` (see vae.vae_scale_factor_of): the starting noise's layout.
   The constructor keeps only what is the family's own beside that (tokenizers, VAE scaling, checks).
2. Implement:
   - `from_pretrained(model, device, dtype)`: `model` is "embedded" or a local diffusers folder; load from local
     disk only. `folder.PipelineFolder.open(model, "<diffusers pipeline class>")` reads it (its name, model_index.json,
     scheduler config, stepserve.json) and its `load(dtype, name=Class, ...)` loads the sub-folders' components.
   - `encode(params_list) -> list[Conditioning]`: one per request (resolved SamplingParams: every field set),
     batched over the requests. A `Conditioning` holds the denoiser keyword arguments of the request's
     conditional row (`cond`) and, when the request uses classifier-free guidance, of its unconditional row
     (`uncond`; None otherwise: the family decides, e.g. SD/SDXL/SD3 when guidance_scale > 1). Every tensor has
     a leading row dimension of 1, so the executor builds a step's batch with one `torch.cat` per key. Put
     per-request extras here (SDXL's pooled embeds and add_time_ids; Flux's guidance value as a (1,) tensor).
     `encode_prompts(prompts)` runs the text encoders through the prompt cache: implement `_encode_missing`.
   - `noise_shape(height, width)`: the shape diffusers draws the starting noise in, `(1, ...)` (the base class's:
     `(1, latent_channels, height / vae_scale_factor, width / vae_scale_factor)`); `initial_latents`
     draws it from the request's CPU generator in `dtype` and calls `pack_latents`. Override `pack_latents` /
     `unpack_latents` when the denoiser sees another layout (Flux's 2x2 packing): samplers and `denoise` then
     see packed (1, ...) rows, and `decode` receives packed latents.
   - `denoise(sample, timestep, conditioning) -> prediction` (the base class calls the networks): ONE forward
     over the step's rows, each at its own timestep (`timestep`: (rows,) float32 in the scheduler's units, as
     diffusers' scheduler.timesteps; rescale inside if the network wants another, e.g. Flux's t / 1000). Call
     `self.networks.denoise(sample, timestep, **kwargs)` with every tensor batched on dim 0, so backend wrappers
     can pad rows generically; what is the same for every row of a size bucket (Flux's image/text ids) is built
     inside the networks object from the shapes. The prediction has the sample's shape.
   - `decode(latents, size) -> list[PIL.Image]` for a batch of finished latents of one size bucket,
     `size = (height, width)` (what unpacking needs); `vae.to_pil` rounds as diffusers' image processor does.
   - Optionally `schedule_options(params)`: extra keywords for `sampling.build_schedule` (Flux: `mu` from the
     requested size), or override `schedule(params)` entirely; `collate(rows)` when rows of one step can differ
     in shape (pad + mask); `combine_guidance(cond, uncond, scale)` when CFG is not the plain formula;
     ControlNets (stepserve/controls): a mixin of control_inputs.py (or one like it), the denoiser passing the
     control keywords through.
   - Declare what it serves in capabilities.py's FAMILIES (one `Capabilities`: image to image, inpainting, LoRA,
     caches, ControlNets and with what, IP-Adapters, video) and set `torch_networks` to the class of its own torch
     networks: validation, refusals and the docs read the declaration, and the add-ons run while `networks` is one
     of those (not an export, not the fast path's wrappers). A declared add-on needs the hooks of its Protocol
     there (tests/pipelines/test_capabilities.py checks every family).
3. Register it: one line in `registry.py`'s `FAMILIES`, from the model_index.json `_class_name` to
   "module:Class". `Engine.from_pretrained`, `stepserve serve --model` and the bench then load it (backend
   torch; the exported backends stay SD 1/2 only).
4. Add `stepserve/tiny/<family>.py` (`build_tiny_<family>(path, seed=0, **options) -> Path`: an offline random
   folder) and a test that compares served images with the family's diffusers pipeline run per request under
   every strategy (see tests/pipelines/test_sdxl.py).

Guidance: the executor adds the `uncond` rows of the requests that have one and mixes
`uncond + guidance_scale * (cond - uncond)` per request; an "embedded" family leaves `uncond` None and feeds the
value through `cond`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from PIL import Image
from torch import Tensor

from .. import sampling
from ..request.types import ModelInfo, SamplingParams
from ..capabilities import Capabilities, capabilities
from .prompt_cache import PromptCache

GUIDANCE_MODES = ("cfg", "embedded")
ADAPTER_CACHE_SETS = 64  # LoRA adapter sets whose encoded prompts are kept (stepserve/lora)


@dataclass
class Conditioning:
    """One request's denoiser inputs besides sample and timestep: keyword -> tensor with a leading row dim of 1."""

    cond: dict[str, Tensor]
    uncond: dict[str, Tensor] | None = None  # the classifier-free-guidance row; None: the request has none

    @property
    def guided(self) -> bool:
        return self.uncond is not None


def stack_rows(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Per-row keyword dicts -> one dict of tensors batched on dim 0 (in row order)."""
    return {key: torch.cat([row[key] for row in rows]) for key in rows[0]}


class FamilyAdapter:
    """Base of every family adapter; see the module docstring for what a subclass implements."""

    family: ClassVar[str] = ""
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype
    scheduler_config: dict
    networks: Any
    backend: str = "torch"
    prompt_cache_size: ClassVar[int] = 1024  # encoded prompts kept; a family with large embeddings keeps fewer
    torch_networks: ClassVar[type | None] = None  # the family's own torch networks: where its add-ons run
    controls_from_conditional_row: ClassVar[bool] = False  # ControlHooks (capabilities.py): Qwen-Image's true CFG

    def __init__(self, networks: Any, *, scheduler_config: dict, info: ModelInfo, latent_channels: int,
                 vae_scale_factor: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
                 ) -> None:
        """What every family keeps: its networks, the folder's scheduler config, its ModelInfo, the latent layout
        the denoiser starts from (channels, and the VAE's downscale of height and width), where and in what dtype
        it runs, and a cache of encoded prompts."""
        self.networks = networks
        self.scheduler_config = dict(scheduler_config)
        self.info = info
        self.latent_channels = latent_channels
        self.vae_scale_factor = vae_scale_factor
        self.device = torch.device(device)
        self.dtype = dtype
        self.prompt_cache = PromptCache(self.prompt_cache_size)
        self._adapter_caches: OrderedDict[tuple, PromptCache] = OrderedDict()  # per LoRA adapter set (text encoders)

    @property
    def capabilities(self) -> Capabilities:
        """What the family serves (capabilities.py: its one declaration)."""
        return capabilities(self.family)

    def _own_networks(self) -> bool:
        """Its networks are the family's own torch networks (not an export's runtime, not the fast path's wrapper,
        which passes their attributes through)."""
        return self.torch_networks is not None and isinstance(self.networks, self.torch_networks)

    @property
    def runs_controls(self) -> bool:
        """ControlNets (stepserve/controls) run here: the family declares them and runs its own torch networks (not
        an export, not the fast path's fixed-shape wrappers)."""
        return self.capabilities.controlnets and self._own_networks()

    @property
    def runs_ip_adapters(self) -> bool:
        """IP-Adapters (stepserve/ipadapter) go into the denoiser's attention: as runs_controls, for them."""
        return self.capabilities.ip_adapter and self._own_networks()

    def check_sequence_degree(self, n: int) -> None:
        """Before a server splits this family's tokens over `n` sequence ranks (stepserve/parallel): a ValueError,
        one line, for what its forward cannot split evenly. Image tokens are checked per request
        (request/validation.py); a family whose transformer's plan also splits a text of fixed length says so
        here."""

    # --- per request -------------------------------------------------------------------------------------------
    def encode(self, params: list[SamplingParams]) -> list[Conditioning]:
        raise NotImplementedError

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> list[Any]:
        """The text encoders' output per prompt (what the family's `_encode_missing` returns for one prompt),
        batched over the distinct prompts not in the prompt cache."""
        return self.prompt_cache.encode(prompts, self._encode_missing)

    @contextlib.contextmanager
    def prompt_cache_for(self, adapters: tuple):
        """Inside the block, encoded prompts are cached for the LoRA adapter set `adapters` (text encoders adapted
        by them encode the same prompt differently); () is the plain cache."""
        if not adapters:
            yield
            return
        cache = self._adapter_caches.pop(adapters, None) or PromptCache(self.prompt_cache_size // 8 or 1)
        self._adapter_caches[adapters] = cache
        while len(self._adapter_caches) > ADAPTER_CACHE_SETS:
            self._adapter_caches.popitem(last=False)
        plain, self.prompt_cache = self.prompt_cache, cache
        try:
            yield
        finally:
            self.prompt_cache = plain

    def _encode_missing(self, prompts: list[str]) -> list[Any]:
        """Encode distinct prompts in one batch: one value per prompt, in order."""
        raise NotImplementedError

    def schedule_options(self, params: SamplingParams) -> dict:
        """Extra keyword arguments for sampling.build_schedule for this request (none by default)."""
        return {}

    def schedule(self, params: SamplingParams) -> sampling.Schedule:
        return sampling.build_schedule(params.sampler, self.scheduler_config, params.num_inference_steps,
                                       **self.schedule_options(params))

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        """(1, latent_channels, height / vae_scale_factor, width / vae_scale_factor): the latents of a UNet or DiT
        family. Override for another layout (Flux's even latent grid)."""
        return (1, self.latent_channels, int(height) // self.vae_scale_factor, int(width) // self.vae_scale_factor)

    def initial_latents(self, params: SamplingParams, generator: torch.Generator) -> Tensor:
        """The starting noise as diffusers draws it (one CPU generator per request, the pipeline's dtype), packed
        for the denoiser. The executor scales it by the schedule's init_noise_sigma."""
        noise = torch.randn(self.noise_shape(params.height, params.width), generator=generator, dtype=self.dtype)
        return self.pack_latents(noise.to(self.device))

    def pack_latents(self, latents: Tensor) -> Tensor:
        return latents

    # --- image to image ----------------------------------------------------------------------------------------
    image_processor_scale: ClassVar[int] = 1  # the VaeImageProcessor's factor, in units of vae_scale_factor

    def start_latents(self, generator: torch.Generator, schedule, step: int, encoded: Tensor) -> Tensor:
        """The starting latents of an image-to-image request as the family's diffusers img2img pipeline makes them:
        its image `encoded` (image_latents: the VAE's distribution sampled with the request's generator first), noise
        drawn next from the same generator, mixed at the level of `step` by the sampler's scheduler, packed."""
        from ..sampling.img2img import add_noise

        noise = torch.randn(encoded.shape, generator=generator, dtype=encoded.dtype).to(encoded.device)
        return self.pack_latents(add_noise(schedule, encoded, noise, step))

    def image_latents(self, pixels: Tensor, generator) -> Tensor:
        """Images (image_pixels, batched on dim 0) in the denoiser's (unpacked) latent space, as the family's img2img
        pipeline encodes one: the VAE's distribution sampled with `generator` (one per row, or a list of them: each
        row is then drawn from its own, as that row alone would be). Families that serve img2img implement it."""
        raise NotImplementedError

    def inpaint_latents(self, pixels: Tensor, generator) -> Tensor:
        """image_latents as the family's inpaint pipeline encodes (SDXL's scales differently)."""
        return self.image_latents(pixels, generator)

    inpaint_from_image: ClassVar[bool] = False  # the inpaint pipeline starts from the encoded image at strength 1 too

    def inpaint_channels(self, mask: Tensor, masked_latents: Tensor) -> Tensor:
        """An inpainting UNet's extra input: the mask at latent resolution, then the masked image's latents."""
        mask = torch.nn.functional.interpolate(mask, size=tuple(masked_latents.shape[-2:]))
        return torch.cat([mask.to(masked_latents.dtype), masked_latents], dim=1)

    def image_pixels(self, params: SamplingParams) -> Tensor:
        """The request's image as the pipeline's VaeImageProcessor.preprocess gives it: resized to the request's
        size, (1, 3, H, W) in [-1, 1], on the device in the pipeline's dtype."""
        from diffusers.image_processor import VaeImageProcessor

        processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor * self.image_processor_scale)
        return processor.preprocess(params.image, height=params.height, width=params.width).to(self.device,
                                                                                                 self.dtype)

    def unpack_latents(self, latents: Tensor, size: tuple[int, int]) -> Tensor:
        return latents

    # --- per batch ---------------------------------------------------------------------------------------------
    def collate(self, rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        """One step's per-row conditioning -> the denoiser's batched keywords. Override when rows can differ in
        shape (e.g. text of different lengths: pad and build the attention mask here)."""
        return stack_rows(rows)

    def combine_guidance(self, cond: Tensor, uncond: Tensor, scale: Tensor) -> Tensor:
        """Classifier-free guidance for the guided rows (Ho & Salimans 2022): uncond + s * (cond - uncond), `scale`
        (rows, 1, ...). Override for a family that rescales the result (Qwen-Image's norm-preserving true CFG)."""
        return uncond + scale * (cond - uncond)

    def denoise(self, sample: Tensor, timestep: Tensor, conditioning: dict[str, Tensor],
                cache: list | None = None) -> Tensor:
        """`cache`: per row, how it caches (stepserve/caching.row_caches); None: no row caches."""
        with torch.no_grad():
            if cache is not None:
                return self.networks.denoise_cached(sample, timestep, cache, **conditioning)
            return self.networks.denoise(sample, timestep, **conditioning)

    @property
    def cache_policies(self) -> tuple[str, ...]:
        """The step-caching policies these networks run (stepserve/caching); none on an exported backend or the
        fast path's fixed-shape buckets (whose wrapper passes its inner networks' attributes through, so it must
        be asked which networks these are, not what they have)."""
        return tuple(getattr(self.networks, "cache_policies", ())) if self._own_networks() else ()

    def decode(self, latents: Tensor, size: tuple[int, ...]) -> list:
        """A list of PIL images; a video family (size = (frames, height, width)): a list of frames per request."""
        raise NotImplementedError

    def preview(self, latents: Tensor, size: tuple[int, ...]) -> Image.Image:
        """One preview image of one request's latents (decoded; a video family: its first frame, cheaply)."""
        return self.decode(latents, size)[0]
