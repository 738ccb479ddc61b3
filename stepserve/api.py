"""The offline Python API: Engine.from_pretrained(...).generate([...])."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .clock import Clock, WallClock
from .engine import EngineCore
from .executor.base import Executor
from .scheduling import DEFAULT_MAX_QUEUE_DELAY_MS, LatencyModel, make_policy
from .types import FinishReason, Request, RequestStatus, RequestTiming, SamplingParams

log = logging.getLogger(__name__)

DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("cpu", "cuda")


@dataclass
class GenerationResult:
    request_id: str
    status: RequestStatus
    image: Any  # PIL.Image when completed, else None
    params: SamplingParams  # as resolved: defaults filled in, seed drawn
    timing: RequestTiming
    finish_reason: FinishReason | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.COMPLETED

    @classmethod
    def from_request(cls, r: Request) -> "GenerationResult":
        return cls(r.request_id, r.status, r.image, r.params, r.timing, r.finish_reason, r.error)


@dataclass(frozen=True)
class EngineOptions:
    strategy: str = "continuous"
    max_batch_size: int = 8
    max_queue_delay_ms: float = DEFAULT_MAX_QUEUE_DELAY_MS
    static_batch_size: int | None = None
    max_queue: int | None = None
    # slo: what the policy predicts with. "measure" times this executor at start-up (a few seconds); a path loads
    # a file written by `stepserve profile` / LatencyModel.save; None predicts nothing (see make_policy).
    latency_model: LatencyModel | str | None = None
    slo_order: str = "srs"  # slo: within a priority, shortest remaining steps ("srs") or earliest deadline ("edf")
    max_decode_per_step: int | None = None  # VAE decodes per engine step (None: every image finished in the step)
    answer_margin_s: float = 0.0  # kept before each deadline to hand the answer back (see EngineCore)

    def make_core(self, executor: Executor) -> EngineCore:
        model = resolve_latency_model(self.latency_model, executor, self.max_batch_size)
        policy = make_policy(self.strategy, self.max_batch_size, self.max_queue_delay_ms, self.static_batch_size,
                             latency_model=model, slo_order=self.slo_order)
        return EngineCore(executor, policy, self.max_queue, self.max_decode_per_step, self.answer_margin_s)


def resolve_latency_model(spec: LatencyModel | str | None, executor: Executor,
                          max_batch_size: int) -> LatencyModel | None:
    """A LatencyModel from an option value: itself, "measure" (time this executor now), or a file path."""
    if spec is None or isinstance(spec, LatencyModel):
        return spec
    if spec == "measure":
        from .profiling import measure_latency_model

        return measure_latency_model(executor, max_batch_size)
    return LatencyModel.load(spec)


def load_executor(model: str = "embedded", device: str = "cpu", dtype: str = "float32", backend: str = "torch",
                  threads: int | None = None) -> Executor:
    """Load a diffusers SD-family folder (or the embedded model) for a backend and wrap it in a TorchExecutor.

    backend: "torch" runs the folder's modules; "onnxruntime" runs an ONNX export (an export folder, or the model
    exported once into a cache); "tensorrt" runs engine plans from `stepserve export tensorrt`. The samplers run in
    torch on every backend. `threads`: onnxruntime's intra-op threads (torch's are set by the caller)."""
    import torch

    from .backends import BACKENDS
    from .backends.loading import load_adapter
    from .executor.torch_executor import TorchExecutor

    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not supported; allowed: {', '.join(BACKENDS)}")
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ValueError(f"device: {device!r} is not supported; allowed: {', '.join(DEVICES)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was asked for but no CUDA device is available; use --device cpu")
    return TorchExecutor(load_adapter(model, backend, device, dtype, threads))


class Engine:
    """Serve batches offline: every request of a generate() call is submitted at once, then the engine steps
    until all are done. The batching strategy decides how they share forward passes."""

    def __init__(self, executor: Executor, clock: Clock | None = None, **options: Any) -> None:
        self.executor = executor
        self.options = EngineOptions(**options)
        self.clock = clock or WallClock()
        self.core = self.options.make_core(executor)

    @classmethod
    def from_pretrained(cls, model: str = "embedded", *, device: str = "cpu", dtype: str = "float32",
                        backend: str = "torch", memory_cap: bool = True, compile: bool = False,
                        deterministic: bool = False, fast_path: Any = None, **options: Any) -> "Engine":
        """Load a model and build an engine. With memory_cap, max_batch_size is lowered to what fits in the
        device's memory (profiling.cap_max_batch_size; the reason is logged). The cap measures torch's allocator,
        so it applies to the torch backend only. `compile` (the denoiser compiled per batch-size bucket) and
        `deterministic` (byte-identical images under any load) are the fast path of stepserve.backends.fast_path;
        `fast_path` takes its FastPathOptions whole."""
        executor = load_executor(model, device, dtype, backend)
        if memory_cap and backend == "torch":
            from .profiling import cap_max_batch_size

            options["max_batch_size"], why = cap_max_batch_size(executor, options.get("max_batch_size", 8))
            log.info(why)
        if compile or deterministic or fast_path is not None:
            from .backends.fast_path import FastPathOptions, apply_fast_path

            fast_path = fast_path or FastPathOptions(compile=compile, deterministic=deterministic)
            apply_fast_path(executor, fast_path, options.get("max_batch_size", 8))
        return cls(executor, **options)

    @property
    def model(self):
        return self.executor.model

    def generate(self, params: list[SamplingParams], progress: bool = False) -> list[GenerationResult]:
        """Generate one image per SamplingParams; results come back in input order. Bad input raises
        ValidationError before anything runs; a request that fails while running has `ok == False` and `error`.

        A list longer than the queue (`max_queue`) is fed in as room frees up. If generate() is interrupted, the
        requests it queued are cancelled before it returns, so nothing of this call runs inside a later one."""
        from .validation import resolve_params

        core = self.core
        for p in params:  # validate everything first: a bad request must not leave others half-submitted
            resolve_params(p, self.model)
        to_feed = list(params)
        requests: list[Request] = []
        bar = None
        if progress:
            from .progress import progress as progress_bar

            bar = progress_bar(len(to_feed), f"generate ({self.options.strategy})", "img")
        try:
            while to_feed or any(not r.is_finished for r in requests):
                now = self.clock.now()
                while to_feed and (core.max_queue is None or len(core.waiting) < core.max_queue):
                    requests.append(core.add_request(to_feed.pop(0), now))
                # no arrival can come before the policy acts: everything is in, or the queue is full
                core.draining = not to_feed or (core.max_queue is not None and len(core.waiting) >= core.max_queue)
                report = core.step(now)
                self.clock.elapse(report.duration_s)
                if bar is not None and report.finished:
                    bar.update(len(report.finished))
                if report.batch_size == 0 and not report.finished:
                    if report.wake_at is None:
                        raise RuntimeError(f"policy {self.options.strategy!r} made no progress with work waiting")
                    self.clock.sleep_until(report.wake_at)
        finally:
            core.draining = False
            core.cancel_now([r.request_id for r in requests if not r.is_finished], self.clock.now())
            if bar is not None:
                bar.close()
        return [GenerationResult.from_request(r) for r in requests]
