"""The offline Python API: Engine.from_pretrained(...).generate([...])."""

from __future__ import annotations

import logging
from typing import Any

from .addons.budgets import AUTO
from .engine.clock import Clock, WallClock
from .engine.config import EngineConfig, EngineOptions, build_engine, options_from
from .executor.base import Executor
from .request.types import GenerationResult, Request, SamplingParams

log = logging.getLogger(__name__)


class Engine:
    """Serve batches offline: every request of a generate() call is submitted at once, then the engine steps
    until all are done. The batching strategy decides how they share forward passes."""

    def __init__(self, executor: Executor, clock: Clock | None = None, options: EngineOptions | None = None,
                 **overrides: Any) -> None:
        self.executor = executor
        self.options = options_from(options, overrides)
        self.clock = clock or WallClock()
        self.core = self.options.make_core(executor)

    @classmethod
    def from_pretrained(cls, model: str = "embedded", *, device: str = "cpu", dtype: str = "float32",
                        backend: str = "torch", memory_cap: bool = True, compile: bool = False,
                        deterministic: bool = False, fast_path: Any = None, threads: int | None | str = "auto",
                        cache: Any = None, lora_dir: str | None = None, lora_memory_mb: float | str | None = AUTO,
                        controlnet_dir: str | None = None, controlnet_memory_mb: float | str | None = AUTO,
                        ip_adapter_dir: str | None = None, ip_adapter_memory_mb: float | str | None = AUTO,
                        weights: Any = None, degrees: Any = None, **options: Any) -> "Engine":
        """Load a model and build an engine (stepserve.engine.config.build_engine). With memory_cap,
        max_batch_size is lowered to what fits in the device's memory (the reason is logged; torch backend only).
        `compile` (the denoiser compiled per batch bucket) and `deterministic` (byte-identical images under any
        load) are the fast path of stepserve.backends.fast_path; `fast_path` takes its FastPathOptions whole.
        On `backend="onnxruntime"` the model is an export folder (`stepserve export onnx`, or
        stepserve.deploy.onnx_cache.onnx_folder for a cached export of a diffusers folder).
        `threads`: torch's intra-op CPU threads (a process-wide setting): "auto" (the default, as `stepserve
        serve`) is the cores this process may use minus one, at least 1, since a thread on every core makes
        torch's threads spin-wait for the one that feeds them; None leaves torch's setting as it is.
        `cache`: step caching for requests that do not say (docs/CACHING.md); `lora_dir` / `lora_memory_mb`:
        LoRA adapters served from that folder (docs/LORA.md); `controlnet_dir` / `controlnet_memory_mb`: ControlNets
        served from that folder (docs/CONTROLNET.md); `ip_adapter_dir` / `ip_adapter_memory_mb`: IP-Adapters
        served from that folder (docs/CONTROLNET.md); each memory in MiB, "auto" (the default) sized for `dtype`
        (stepserve/addons/budgets.py), None for no bound; `weights` (stepserve.pipelines.weights.Weights): the
        denoiser from a single or GGUF file, quantized on load, or offloaded (docs/MODELS.md); `degrees`
        (stepserve.parallel.degrees.Degrees): one request split over several devices (docs/SCALING.md)."""
        if fast_path is None and (compile or deterministic):
            from .backends.fast_path import FastPathOptions

            fast_path = FastPathOptions(compile=compile, deterministic=deterministic)
        if threads == "auto":
            threads = _auto_threads() if device == "cpu" else None
        config = EngineConfig(model=model, device=device, dtype=dtype, backend=backend, threads=threads,
                              memory_cap=memory_cap, fast_path=fast_path, cache=cache, lora_dir=lora_dir,
                              degrees=degrees,
                              lora_memory_mb=lora_memory_mb, controlnet_dir=controlnet_dir,
                              controlnet_memory_mb=controlnet_memory_mb, ip_adapter_dir=ip_adapter_dir,
                              ip_adapter_memory_mb=ip_adapter_memory_mb, weights=weights,
                              options=EngineOptions(**options))
        built = build_engine(config)
        return cls(built.executor, options=built.options)

    @property
    def model_info(self):
        return self.executor.model_info

    def _load_adapters(self, params: list) -> None:
        """Load the folder's LoRA adapters these requests name before any of them runs (all of them must fit the
        adapter memory together; ValidationError on field "loras" when they do not)."""
        names = [n for p in params for n, _ in (p.loras or ())]
        store = getattr(self.executor, "_adapters", None)
        if not names or store is None:
            return
        from .lora.errors import LoraError
        from .request.validation import ValidationError

        try:
            store.ensure(names)
        except LoraError as exc:
            raise ValidationError("loras", str(exc)) from None

    def generate(self, params: list[SamplingParams], progress: bool = False) -> list[GenerationResult]:
        """Generate one image per SamplingParams; results come back in input order. Bad input raises
        ValidationError before anything runs; a request that fails while running has `ok == False` and `error`.

        A list longer than the queue (`max_queue`) is fed in as room frees up. If generate() is interrupted, the
        requests it queued are cancelled before it returns, so nothing of this call runs inside a later one."""
        from .request.validation import resolve_params

        core = self.core
        # resolve everything first: a bad request must not leave others half-submitted
        to_feed = [resolve_params(p, self.model_info) for p in params]
        self._load_adapters(to_feed)
        requests: list[Request] = []
        bar = None
        if progress:
            from .util.progress import progress as progress_bar

            bar = progress_bar(len(to_feed), f"generate ({self.options.strategy})", "image")
        try:
            while to_feed or any(not r.is_finished for r in requests):
                now = self.clock.now()
                while to_feed and (core.max_queue is None or len(core.waiting) < core.max_queue):
                    requests.append(core.add_request(to_feed.pop(0), now))
                # no arrival can come before the policy acts: everything is in, or the queue is full
                core.draining = not to_feed or (core.max_queue is not None and len(core.waiting) >= core.max_queue)
                try:
                    report = core.step(now)
                except RanksLost as exc:  # a worker rank died or failed: nothing more can run in this engine
                    raise EngineDeadError(f"this model's ranks failed ({exc}); make a new engine") from None
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


from .engine.handles import EngineDeadError  # noqa: E402
from .parallel.ranks import RanksLost  # noqa: E402


def _auto_threads() -> int:
    """from_pretrained's default CPU threads: the cores this process may use minus one (as `stepserve serve`)."""
    from .engine.loading import default_threads

    return default_threads()
