"""Runs engine steps on a real pipeline (any model family, pipelines/family.py) and measures each stage's time.

One denoising forward covers every request in the step, each at its own timestep. Classifier-free guidance is
per request: a request whose conditioning has an unconditional row (the family decides: SD/SDXL when
guidance_scale > 1) adds that row; the others pay for one row only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace

import torch

from .. import sampling
from ..caching.spec import with_default
from ..caching.rows import reuses_before, row_caches
from ..controls import rows as controls
from ..ipadapter import rows as image_prompts
from ..sampling.img2img import starting_at
from ..lora.rows import adapter_rows, every_row
from ..lora.serving import check_loaded, row_keys, text_keys
from ..pipelines import inpaint
from ..pipelines.family import FamilyAdapter
from ..sampling.common import to_device
from ..request.buckets import Bucket
from ..request.types import Request
from ..request.validation import first_denoising_step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchExecutor:
    def __init__(self, pipeline: FamilyAdapter) -> None:
        self.pipeline = pipeline
        self.device = pipeline.device
        self.default_cache = None  # step caching for requests that do not say (any form cache_spec takes)
        self._base_info = pipeline.info
        self._info: tuple = (None, None)
        # held while a stage runs; LoRA loads and deletes take it, so they never change the networks mid-step
        self.lock = threading.RLock()
        self._adapters = None  # stepserve.lora.AdapterStore, made on first use
        self._controlnets = None  # stepserve.controls.store.ControlNetStore, made by serve_controlnets
        self._ip_adapters = None  # stepserve.ipadapter.store.IPAdapterStore, made by serve_ip_adapters
        self.split = None  # stepserve.parallel.split.Split: this rank's share of a forward split over several ranks

    @property
    def model_info(self):
        """The pipeline's ModelInfo with the step-caching policies its networks run now (none once the fast path
        wraps them) and the default cache."""
        adapters = self._adapters
        key = (id(self._base_info), id(self.pipeline.networks), repr(self.default_cache),
               adapters.version if adapters is not None else 0, adapters.folder_stamp() if adapters else None,
               (self._controlnets.names, self._controlnets.guess_only) if self._controlnets is not None else None,
               self._ip_adapters.names if self._ip_adapters is not None else None)
        if self._info[0] != key:
            info = with_default(self._base_info, self.pipeline.cache_policies, self.default_cache)
            if adapters is not None:
                info = replace(info, lora_names=adapters.names)
            if self.pipeline.runs_controls:
                store = self._controlnets
                info = replace(info, controls=True, control_names=store.names if store is not None else frozenset(),
                               control_guess_only=store.guess_only if store is not None else frozenset())
            if self.pipeline.runs_ip_adapters:
                info = replace(info, ip_adapters=True, ip_adapter_names=self._ip_adapters.names
                               if self._ip_adapters is not None else frozenset())
            self._info = (key, info)
        return self._info[1]

    def adapters(self, root=None, budget_bytes=None):
        """The LoRA adapters this executor serves (stepserve.lora.AdapterStore; `root`: the folder adapter files
        come from, `budget_bytes`: their memory; both set on first use). Raises stepserve.lora.LoraError where the
        pipeline serves none."""
        if self._adapters is None:
            from ..lora.store import AdapterStore

            self._adapters = AdapterStore(self.pipeline, self.lock, root, budget_bytes)
        return self._adapters

    def controlnets(self, root=None, budget_bytes=None):
        """The ControlNets this executor serves (stepserve.controls.store.ControlNetStore; `root`: the ControlNet
        folder, `budget_bytes`: their memory; both set on first use)."""
        if self._controlnets is None:
            from ..controls.store import ControlNetStore

            self._controlnets = ControlNetStore(self.pipeline, root, budget_bytes)
        return self._controlnets

    def ip_adapters(self, root=None):
        """The IP-Adapters this executor serves (stepserve.ipadapter.store.IPAdapterStore; `root`: the IP-Adapter
        folder, set on first use)."""
        if self._ip_adapters is None:
            from ..ipadapter.store import IPAdapterStore

            self._ip_adapters = IPAdapterStore(self.pipeline, root, self.lock)
        return self._ip_adapters

    @model_info.setter
    def model_info(self, info) -> None:
        self._base_info = info

    # The engine core only sees these durations; measuring them is the executor's job. Every forward of a stage
    # (encoders, the denoiser, ControlNets, IP-Adapters, the VAE) runs under inference_mode: no autograd graph is
    # kept alive (a ControlNet's weights require grad) and nothing a step makes can require grad.
    def _timed(self, fn, *args) -> float:
        _sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            fn(*args)
        _sync(self.device)
        return time.perf_counter() - start

    def prepare(self, requests: list[Request]) -> float:
        with self.lock:
            return self._timed(self._prepare, requests)

    def denoise(self, requests: list[Request]) -> float:
        with self.lock:
            return self._timed(self._denoise, requests)

    def decode(self, requests: list[Request]) -> float:
        with self.lock:
            return self._timed(self._decode, requests)

    # --- stages ------------------------------------------------------------------------------------------------
    def _encode(self, requests: list[Request]) -> list:
        """The pipeline's conditioning per request; requests whose LoRA adapters adapt a text encoder are encoded
        per adapter set, with those adapters on every row and a prompt cache of that set's own."""
        p = self.pipeline
        keys = [self._text_adapters(r) for r in requests]
        if not any(keys):
            return p.encode([r.params for r in requests])
        out: list = [None] * len(requests)
        for key in dict.fromkeys(keys):
            at = [i for i, k in enumerate(keys) if k == key]
            # the cache is also keyed by the store's version: an adapter loaded again under its name encodes anew
            with p.prompt_cache_for((key, self._adapters.version)), every_row(key):
                for i, conditioning in zip(at, p.encode([requests[i].params for i in at])):
                    out[i] = conditioning
        return out

    def _text_adapters(self, r: Request) -> tuple:
        return text_keys(self._adapters, r.params.loras)

    def _prepare(self, requests: list[Request]) -> None:
        self._check_adapters(requests)
        p = self.pipeline
        # Seeds mean what they mean in diffusers: the latents, then any later noise, from one CPU generator.
        generators = [torch.Generator("cpu").manual_seed(r.params.seed) for r in requests]
        for r, generator in zip(requests, generators):
            if r.params.controls:  # its control images, prepared once (stepserve/controls)
                self._controlnets.ensure([c.name for c in r.params.controls], holder=r)  # held until it ends
                # before the start image and the noise: the ControlNet pipelines encode it first (Flux.1 samples it)
                r.controls = controls.prepare(p, r.params, generator)
        images = inpaint.encode_start_images(p, [r.params for r in requests], generators)  # one VAE pass per size
        if any(getattr(r.params, "ip_adapter", None) for r in requests):  # image prompts, encoded once (ipadapter/)
            image_prompts.prepare(self.ip_adapters(), requests)
        for r, conditioning, generator, image in zip(requests, self._encode(requests), generators, images):
            r.conditioning = conditioning
            schedule = p.schedule(r.params)
            if schedule.num_steps != r.num_inference_steps:  # every sampler's table has one entry per step asked
                raise RuntimeError(f"the {r.params.sampler} schedule has {schedule.num_steps} steps for "
                                   f"num_inference_steps={r.num_inference_steps}")
            if r.params.image is None:
                r.latents = p.initial_latents(r.params, generator) * sampling.init_noise_sigma(schedule)
            elif r.params.mask_image is not None:  # inpainting (pipelines/inpaint.py)
                schedule = starting_at(schedule, r.step)
                r.latents, r.inpaint = inpaint.start(p, r.params, generator, schedule, r.step, image)
            else:  # img2img: the encoded image (sampled with the generator), noised to the step it starts at
                schedule = starting_at(schedule, r.step)
                r.latents = p.start_latents(generator, schedule, r.step, image)
            r.sampler_state = sampling.new_state(schedule, generator)

    def _check_adapters(self, requests: list[Request]) -> None:
        check_loaded(self._adapters, [r.params.loras for r in requests])  # LookupError: the engine isolates them

    def _denoise(self, requests: list[Request]) -> None:
        self._check_adapters(requests)
        states = [r.sampler_state for r in requests]
        steps = [r.step for r in requests]
        latents = torch.cat([r.latents for r in requests])
        model_in, timesteps = sampling.model_inputs(latents, states, steps)
        latents_in = model_in  # what a ControlNet takes: the latents alone, as diffusers' inpaint pipelines give it
        model_in = inpaint.with_extra_channels(model_in, requests)  # an inpainting UNet's mask and masked image
        # Rows: every request's conditional row, then the unconditional row of each guided request.
        guided = [i for i, r in enumerate(requests) if r.conditioning.guided]
        at = to_device(torch.tensor(guided, dtype=torch.int64), latents.device)  # no host sync (sampling/common.py)
        rows = torch.cat([model_in, model_in[at]]) if guided else model_in
        t_rows = torch.cat([timesteps, timesteps[at]]) if guided else timesteps
        # the rows this rank runs: all of them, or its half with --cfg-parallel (stepserve/parallel/split.py)
        n, total = len(requests), len(requests) + len(guided)
        mine = self.split.rows(n, total) if self.split is not None else range(total)
        per_row = [r.conditioning.cond for r in requests] + [requests[i].conditioning.uncond for i in guided]
        conditioning = self.pipeline.collate([per_row[i] for i in mine]) if len(mine) else {}
        caches = row_caches(requests, guided)  # None unless some request caches steps
        if any(r.controls for r in requests) and len(mine):  # the ControlNets' residuals per row (stepserve/controls)
            control_rows = torch.cat([latents_in, latents_in[at]]) if guided else latents_in
            residuals = self._control_residuals(requests, guided, mine, control_rows, t_rows, per_row,
                                                conditioning, caches)
            conditioning = {**conditioning, **residuals}
        loras = [r.params.loras for r in requests] + [requests[i].params.loras for i in guided]
        out = None
        if len(mine):
            mine_caches = None if caches is None else [caches[i] for i in mine]
            with adapter_rows(row_keys(self._adapters, [loras[i] for i in mine])), \
                    self._image_prompt_rows(requests, guided, mine) as image_prompt:  # each row's LoRAs, image prompt
                conditioning = {**conditioning, **image_prompt}
                sl = slice(mine.start, mine.stop)
                if mine_caches is None:
                    out = self.pipeline.denoise(rows[sl], t_rows[sl].to(rows.device), conditioning)
                else:
                    out = self.pipeline.denoise(rows[sl], t_rows[sl].to(rows.device), conditioning, mine_caches)
        if self.split is not None:
            out = self.split.gather(out, n, total, latents[:1].to(self.pipeline.dtype))  # the networks' output dtype
        if caches is not None:
            for r, row in zip(requests, caches):  # the conditional row speaks for the request
                r.timing.cached_steps += bool(row is not None and row.skipped)
        pred = out[: len(requests)]
        if guided:
            cond = pred[at]
            uncond = out[len(requests):]
            scale = to_device(torch.tensor([requests[i].params.guidance_scale for i in guided], dtype=out.dtype),
                              out.device).view(-1, *([1] * (out.dim() - 1)))
            pred = pred.clone()
            pred[at] = self.pipeline.combine_guidance(cond, uncond, scale)
        wants = [i for i, r in enumerate(requests) if r.step + 1 in r.preview_steps]
        if wants:  # x0 estimates for preview images, only for the rows that asked for one at this step
            x0 = sampling.predicted_original(pred[wants], latents[wants], [states[i] for i in wants],
                                             [steps[i] for i in wants])
            for j, i in enumerate(wants):
                requests[i].preview_latents = x0[j : j + 1]
        new = inpaint.blend(requests, sampling.sampler_step(pred, latents, states, steps))
        for i, r in enumerate(requests):
            r.latents = new[i : i + 1]

    def _control_residuals(self, requests: list[Request], guided: list[int], mine: range, rows, t_rows,
                           per_row: list, conditioning: dict, caches) -> dict:
        """The control keywords of the rows `mine` (this rank's: all the step's rows, or its CFG half): `rows`,
        `t_rows`, `per_row` (each row's conditioning) and `caches` hold every row of the step, `conditioning` the
        rows of `mine` collated. With guidance a request's control applies to both its rows, as diffusers' pipeline
        applies it (in guess mode to the conditional row only): each row runs the ControlNets, or, where the
        family's pipeline runs them once on the prompt (Qwen-Image), the unconditional row takes its conditional
        row's outputs (controls.sources: a CFG half runs them on the rows it needs only). A control's window is a
        fraction of the steps the request runs: an image's strength shortens the schedule, and the ControlNet
        img2img and inpaint pipelines count from its first step. A row known to reuse the UNet's deep part at this
        step (`caches`: deepcache) runs its ControlNets only as far as its shallow part takes."""
        firsts = [first_denoising_step(r.params, self.pipeline.info) for r in requests]
        specs = [(r.controls, r.step - f, r.num_inference_steps - f) for r, f in zip(requests, firsts)]
        from_conditional = self.pipeline.controls_from_conditional_row
        if not from_conditional:
            specs += [(controls.unconditional(requests[i].controls), *specs[i][1:]) for i in guided]
        run, pick = controls.sources(len(requests), guided, mine, from_conditional)
        t_rows = t_rows.to(rows.device)
        if run != list(range(len(rows))):  # a CFG half, or the conditional rows alone (Qwen-Image)
            at = to_device(torch.tensor(run, dtype=torch.int64), rows.device)
            rows, t_rows = rows[at], t_rows[at]
        if run != list(mine):  # conditional rows this half does not denoise: collated with every row, as one
            # process does (the text's padding is the step's longest)
            every = conditioning if len(mine) == len(per_row) else self.pipeline.collate(per_row)
            index = to_device(torch.tensor(run, dtype=torch.int64), rows.device)
            conditioning = {k: v.index_select(0, index) for k, v in every.items()}
        shallow = None
        if caches is not None and self.pipeline.capabilities.caches_with_controls:
            shallow = [reuses_before(caches[i], "deep") for i in run]  # the UNet's cached deep features (caching/)
        out = controls.residuals(self._controlnets, self.pipeline, rows, t_rows, conditioning,
                                 [specs[i] for i in run], shallow)
        return out if pick == list(range(len(run))) else controls.select_rows(out, pick)

    def _image_prompt_rows(self, requests: list[Request], guided: list[int], mine: range):
        """The UNet's IP-Adapter for this forward (the rows `mine` of the step's) when some row has an image prompt
        (stepserve/ipadapter)."""
        if self._ip_adapters is None:
            return contextlib.nullcontext({})
        rows = [(r.image_prompt, True) for r in requests] + [(requests[i].image_prompt, False) for i in guided]
        return image_prompts.applied(self._ip_adapters, self.pipeline.unet, [rows[i] for i in mine])

    def _decode(self, requests: list[Request]) -> None:
        buckets: dict[Bucket, list[Request]] = {}
        for r in requests:  # one decode per size bucket (finished requests may come from several)
            buckets.setdefault(r.bucket, []).append(r)
        for bucket, group in buckets.items():
            images = self.pipeline.decode(torch.cat([r.latents for r in group]), bucket)
            for r, image in zip(group, images):
                if len(bucket) == 3:  # a video bucket decodes to a list of frames per request
                    r.frames, image = image, image[0]
                r.image = image

    def preview(self, request: Request):
        """A preview image: the decoded x0 estimate of the last step if one was kept, else the current latents (a
        video's first frame: pipeline.preview)."""
        latents = request.preview_latents if request.preview_latents is not None else request.latents
        request.preview_latents = None
        with torch.inference_mode():
            return self.pipeline.preview(latents, request.bucket)
