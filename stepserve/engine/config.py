"""One way to build an engine: `build_engine(EngineConfig(...))`.

Every place that serves a model builds its engine here: `Engine.from_pretrained`, `stepserve serve` and its Ray
Serve replicas, the model that runs inside tritonserver, `stepserve profile` and the in-process bench. The steps,
in order:

1. torch's intra-op threads (`threads`, when given);
2. the model argument -> an executor (stepserve.engine.loading);
3. the memory cap: max_batch_size lowered to what fits (torch backend; stepserve.profiling.memory);
4. the fast path: compiled batch buckets or the deterministic mode (stepserve.backends.fast_path);
5. the latency model the slo policy predicts with (`resolve_latency_model`: given, loaded or measured).

What comes back (`BuiltEngine`) is the executor and the EngineOptions it serves with; `EngineOptions.make_core`
turns them into an EngineCore for the offline Engine, the AsyncEngine or a bench contender.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..addons.budgets import AUTO, NAMES, memory_mb
from .core import EngineCore
from ..costs import LatencyModel
from ..scheduling import DEFAULT_MAX_QUEUE_DELAY_MS, DEFAULT_STRATEGY, make_policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    """How the engine batches: the policy and its settings."""

    strategy: str = DEFAULT_STRATEGY
    max_batch_size: int = 8
    max_queue_delay_ms: float = DEFAULT_MAX_QUEUE_DELAY_MS
    static_batch_size: int | None = None
    max_queue: int | None = None
    # slo: what the policy predicts with. "measure" times the executor at start-up (a few seconds); a path loads
    # a file written by `stepserve profile` / LatencyModel.save; None predicts nothing (see make_policy).
    latency_model: LatencyModel | str | None = None
    slo_order: str = "srs"  # slo: within a priority, shortest remaining steps ("srs") or earliest deadline ("edf")
    max_decode_per_step: int | None = None  # VAE decodes per engine step (None: every image finished in the step)
    answer_margin_s: float = 0.0  # kept before each deadline to hand the answer back (see EngineCore)

    def make_core(self, executor: Any) -> EngineCore:
        latency = resolve_latency_model(self.latency_model, executor, self.max_batch_size)
        policy = make_policy(self.strategy, self.max_batch_size, self.max_queue_delay_ms, self.static_batch_size,
                             latency_model=latency, slo_order=self.slo_order)
        return EngineCore(executor, policy, self.max_queue, self.max_decode_per_step, self.answer_margin_s)


def options_from(options: EngineOptions | None, overrides: dict[str, Any]) -> EngineOptions:
    """EngineOptions given whole, or as keywords (Engine(executor, strategy="dynamic", ...)), not both."""
    if options is not None and overrides:
        raise TypeError(f"give EngineOptions or keyword options, not both (got {', '.join(overrides)})")
    return options if options is not None else EngineOptions(**overrides)


def resolve_latency_model(spec: LatencyModel | str | None, executor: Any, max_batch_size: int,
                          progress: bool | None = None) -> LatencyModel | None:
    """A LatencyModel from an option value: itself, "measure" (time this executor now), or a file path."""
    if spec is None or isinstance(spec, LatencyModel):
        return spec
    if spec == "measure":
        from ..profiling import measure_latency_model

        return measure_latency_model(executor, max_batch_size, progress=progress)
    return LatencyModel.load(spec)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What to serve and how: the model and where it runs, the start-up checks, and the batching options."""

    model: str = "embedded"  # 'embedded', a local diffusers folder, or an export folder (stepserve.engine.loading)
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "torch"  # torch | onnxruntime | tensorrt
    threads: int | None = None  # torch's intra-op threads (onnxruntime's too); None: leave torch's setting
    weights: Any = None  # pipelines.weights.Weights: a single file for the denoiser (--transformer/--unet FILE)
    memory_cap: bool = True  # lower max_batch_size to what fits in memory (torch backend only)
    # the fraction of the device's (or host's) free memory this engine may take: engines that share one (Ray Serve
    # replicas with --replica-gpus 0.5, or several on one host) each take their share, not the whole
    memory_share: float = 1.0
    fast_path: Any = None  # backends.fast_path.FastPathOptions (compile, deterministic); None: off
    warm_up: bool = True  # one throwaway request at start-up, so the first real one is not slow (see warm_up)
    cache: Any = None  # step caching for requests that do not say (stepserve/caching/spec.py forms); None: off
    lora_dir: str | None = None  # LoRA adapters: every one here is servable by name (lora/folder.py); POST reads here
    # each add-on kind's memory in MiB (None: no bound; AUTO: its default for the dtype, stepserve/addons/budgets.py)
    lora_memory_mb: float | str | None = AUTO  # device memory for loaded adapters (least recently used out first)
    controlnet_dir: str | None = None  # ControlNets: every sub-folder here is servable by its name (stepserve/controls)
    controlnet_memory_mb: float | str | None = AUTO  # memory for loaded ControlNets (least recently used out first)
    ip_adapter_dir: str | None = None  # IP-Adapters: every sub-folder here is servable by its name (stepserve/ipadapter)
    ip_adapter_memory_mb: float | str | None = AUTO  # memory for loaded IP-Adapters, image encoders included
    # one request split over several devices (stepserve/parallel: parallel.degrees.Degrees); None: one device
    degrees: Any = None
    options: EngineOptions = field(default_factory=EngineOptions)


@dataclass
class BuiltEngine:
    executor: Any  # the loaded executor, fast path applied
    options: EngineOptions  # as configured, with max_batch_size lowered by the memory cap and the latency model
    # resolved (a LatencyModel or None)

    def make_core(self) -> EngineCore:
        return self.options.make_core(self.executor)


def build_engine(config: EngineConfig, say: Callable[[str], None] = log.info, executor: Any = None) -> BuiltEngine:
    """Load and prepare what `config` asks for; `say` hears one line per start-up decision (memory cap, latency
    model). `executor`: one already loaded (a fake, or one shared between engines), used instead of loading.
    Raises FileNotFoundError or ValueError with a message naming the setting and what is allowed."""
    from ..executor.fake import is_fake
    from .loading import check_pairs, load_executor

    check_pairs(config)  # a pair of features no family serves together: one line, before anything loads
    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    if executor is None and is_fake(config.model):  # the simulated accelerator: nothing to load, measure or warm
        from ..executor.fake import check_fake, fake_executor

        check_fake(config)
        executor = fake_executor(config.options.latency_model)
        config = replace(config, memory_cap=False, warm_up=False, fast_path=None)
    loaded = executor is None
    if not loaded or config.degrees is None or not config.degrees.enabled:
        if loaded:
            executor = load_executor(config.model, config.device, config.dtype, config.backend, config.threads,
                                     config.weights)
        return _prepare(config, executor, loaded, say)
    from ..parallel.ranks import RanksLost
    from ..parallel.start import start_ranks

    config = _threads_per_rank(config, say)
    executor = load_executor(config.model, config.device, config.dtype, config.backend, config.threads,
                             config.weights)
    executor = start_ranks(executor, config, say)  # the other ranks load meanwhile
    try:
        return _prepare(config, executor, loaded, say)
    except BaseException as exc:  # no worker or process group is left behind by a start that fails
        executor.close()
        if isinstance(exc, RanksLost):
            raise ValueError(f"{config.degrees.describe()}: {exc}") from None
        raise


def _threads_per_rank(config: EngineConfig, say: Callable[[str], None]) -> EngineConfig:
    """On the CPU every rank runs `threads` threads: ranks times threads fit the cores, one spare (default_threads'
    reason: the thread that feeds the engine needs one) where there are more cores than ranks."""
    from .loading import available_cores

    world, cores = config.degrees.world, available_cores()
    if str(config.device).startswith("cuda") or not config.threads or config.threads * world <= cores:
        return config
    threads = max(1, (cores - 1) // world)
    say(f"{config.degrees.describe()}: {threads} thread(s) per rank ({world} ranks on {cores} cores), not "
        f"{config.threads}")
    import torch

    torch.set_num_threads(threads)
    return replace(config, threads=threads)


def _prepare(config: EngineConfig, executor: Any, loaded: bool, say: Callable[[str], None]) -> BuiltEngine:
    """The memory cap, the fast path or the warm-up, the add-ons and the latency model of a loaded executor."""
    from .serving_addons import serve_addons

    options = config.options
    budgets = {kind: memory_mb(kind, getattr(config, f"{kind}_memory_mb"), config.dtype)
               for kind, folder in (("lora", config.lora_dir), ("controlnet", config.controlnet_dir),
                                    ("ip_adapter", config.ip_adapter_dir)) if folder is not None}
    if config.memory_cap and config.backend != "torch":
        say(f"no memory cap on backend {config.backend}: the check measures torch's allocator")
    elif config.memory_cap:
        from ..profiling import cap_max_batch_size

        # each add-on kind served takes up to its memory (LoRA adapters' per-layer stacks counted in theirs)
        reserve = {NAMES[kind]: int(mb * 2**20) for kind, mb in budgets.items() if mb}
        capped, why = cap_max_batch_size(executor, options.max_batch_size, share=config.memory_share,
                                         reserve_bytes=reserve)
        options = replace(options, max_batch_size=capped)
        say(why)
    if config.fast_path is not None and config.fast_path.enabled:
        from ..backends.fast_path import apply_fast_path

        apply_fast_path(executor, config.fast_path, options.max_batch_size)  # warms up every compiled bucket
    elif loaded and config.warm_up:
        say(f"warm-up: one request through every stage in {warm_up(executor):.2f} s")
    serve_addons(executor, config, budgets, say)
    if options.latency_model == "measure":
        say("measuring the step latency of this model for the slo strategy ...")
    try:
        latency = resolve_latency_model(options.latency_model, executor, options.max_batch_size)
    except OSError as exc:
        raise ValueError(f"latency_model {options.latency_model!r}: {exc}") from None
    return BuiltEngine(executor, replace(options, latency_model=latency))


def warm_up(executor: Any) -> float:
    """One throwaway request through every stage (text encoding, a denoising step, decoding) at the model's
    default size, so that the first real request does not pay for lazy set-up: onnxruntime's first run of a
    session, the allocator's growth, kernel selection. Returns the seconds it took."""
    import time

    from ..request.buckets import bucket_of
    from ..request.types import Request
    from ..request.validation import internal_params

    t0 = time.perf_counter()
    params = internal_params(executor.model_info, prompt="warm-up", seed=0, num_inference_steps=2)
    request = Request("warm-up", params, 0.0, bucket_of(params), params.num_inference_steps)
    executor.prepare([request])
    executor.denoise([request])
    executor.decode([request])
    request.release_tensors()
    return time.perf_counter() - t0
