"""The models of a server of several models (`serve --model A=... --model B=...`, --models-dir, --models FILE): each
one an engine (its own core, policy, buckets, cost curve and deadlines) and an app of its own (create_app: its jobs,
LoRA registrations, ControlNets and IP-Adapters belong to it), all on one SharedDevice (engine/device.py) that runs
one step at a time and keeps the models in device memory, host memory or on disk by use. dispatch.py routes each
HTTP request to its model's app.

A model is loaded at start-up (`eager`) or on its first request; one that went back to disk loads again on its next.
A request that must wait for a load is refused at once with 429 and Retry-After when its deadline is shorter than
the model's last load took, and otherwise waits (its wait counts in its latency: dispatch.py shortens its timeout_s
by the wait).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..engine.device import SharedDevice
from ..scheduling.residency import DISK, too_large
from .errors import APIError, invalid
from .schemas import model_not_found, serves
from .startup import StartupError, start_engine

log = logging.getLogger("stepserve.server")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".onnx")
FAILED_S = 30.0  # a model whose load failed is not tried again for this long (503 with Retry-After meanwhile)


@dataclass(frozen=True)
class ModelSpec:
    """One model a server serves: its name, what to load and how (an EngineConfig), its other names, its weight
    on the device (scheduling/device_share.py) and whether it loads at start-up."""

    name: str
    config: Any  # engine.config.EngineConfig
    aliases: tuple[str, ...] = ()
    weight: float = 1.0
    eager: bool = True


@dataclass
class ModelEntry:
    spec: ModelSpec
    app: Any = None  # its FastAPI app while loaded
    engine: Any = None  # its AsyncEngine while loaded
    stack: AsyncExitStack | None = None  # its app's lifespan while loaded
    loading: asyncio.Task | None = None
    pending: int = 0  # HTTP requests routed to it and not answered
    family: str = ""
    loads: int = 0
    last_load_s: float | None = None
    service: str | None = None  # its jobs' and registrations' service in the store (known once it has loaded)
    failed_at: float | None = None  # when its last load failed (monotonic): loads again only after FAILED_S
    started_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.spec.name


def folder_bytes(model: str) -> int:
    """An estimate of a model's weights before it loads: the sizes of the weight files in its folder (0 when it
    is not a folder, e.g. the embedded model: the reservation is then made good when it is measured)."""
    path = Path(model)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def family_of(model: str) -> str:
    """A model's family before it loads (from its folder's model_index.json), '' when unknown."""
    try:
        from ..pipelines.registry import adapter_class, pipeline_class_name

        return adapter_class(pipeline_class_name(model)).family
    except Exception:  # noqa: BLE001 - shown in /v1/models only; the load says what is wrong
        return "sd" if model == "embedded" else ""


class ModelSet:
    """The models of one server: names and aliases to entries, loads and drops, the shared device."""

    def __init__(self, specs: list[ModelSpec], default: str, device: SharedDevice,
                 make_app: Callable[[ModelSpec, Any], Any]) -> None:
        self.entries = {s.name: ModelEntry(s, family=family_of(s.config.model)) for s in specs}
        self.names: dict[str, str] = {}  # every name a request may give -> its model
        for s in specs:
            for n in (s.name, *s.aliases):
                if self.names.setdefault(n, s.name) != s.name:
                    raise StartupError(f"the name {n!r} is given to two models ({self.names[n]} and {s.name}): "
                                       f"allowed: one model per name")
        self.default = default  # one of them (models_flags.model_specs checks it)
        self.device = device
        self.make_app = make_app  # (spec, engine) -> the model's app (create_app with the server's settings)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.store = None  # the state store the models' jobs live in (models_setup.model_set sets it)
        device.to_disk = self._to_disk

    def served(self) -> list[str]:
        return list(self.names)

    def entry(self, name: str | None) -> ModelEntry:
        """The model a request names (None: the default); 404 model_not_found listing the served names."""
        if name is None:
            return self.entries[self.default]
        if not isinstance(name, str):
            raise invalid(f"model: expected a string naming a served model, got {type(name).__name__}", "model")
        model = self.names.get(name)
        if model is None:
            raise model_not_found(name, self.served())
        return self.entries[model]

    # --- loading -----------------------------------------------------------------------------------------------
    def load_now(self, entry: ModelEntry) -> None:
        """Build a model's engine (blocking: start-up, or a worker thread). Raises StartupError, or APIError 429
        when the device has no room now (every model on it is busy)."""
        spec = entry.spec
        estimate = folder_bytes(spec.config.model)
        if too_large(estimate, self.device.device_bytes):
            raise StartupError(f"model {spec.name} ({estimate / 2**20:.0f} MiB of weights) is larger than "
                               f"--device-memory-mb ({self.device.device_bytes / 2**20:.0f} MiB)")
        if not self.device.reserve(spec.name, estimate):
            raise APIError(429, f"model {spec.name} must load, and the device memory (--device-memory-mb) is held "
                                f"by models with requests in flight; retry later", code="model_loading",
                           headers={"Retry-After": str(self.retry_after_s(entry))})
        started = time.monotonic()
        engine = None
        try:
            engine = start_engine(spec.config, device=self.device, device_name=spec.name)
            from ..executor.placement import place, weight_bytes

            executor = engine.executor
            nbytes = weight_bytes(executor) if hasattr(executor, "pipeline") else estimate
            seconds = time.monotonic() - started
            app = self.make_app(spec, engine)
            self.device.add(spec.name, nbytes, lambda where: place(executor, where) if hasattr(executor, "pipeline")
                            else None, lambda: self._busy(entry), lambda: bool(engine.queue_depth or
                                                                                engine.running_count), load_s=seconds)
        except BaseException:  # nothing of a load that failed stays: its room, its place, its ranks
            self.device.unreserve(spec.name)
            self.device.remove(spec.name)
            if engine is not None:
                engine._close_executor()
            raise
        entry.engine, entry.loads, entry.last_load_s, entry.failed_at = engine, entry.loads + 1, seconds, None
        entry.app, entry.service = app, app.state.server.jobs.service

    async def start(self, entry: ModelEntry) -> None:
        """Run a loaded model's app (its engine thread, jobs and registrations)."""
        stack = AsyncExitStack()
        await stack.enter_async_context(entry.app.router.lifespan_context(entry.app))
        entry.stack = stack

    async def ensure(self, entry: ModelEntry) -> float:
        """The model loaded and running (loading it if it is on disk); returns the seconds waited for it."""
        self.loop = asyncio.get_running_loop()
        if entry.stack is not None:
            return 0.0
        started = time.monotonic()
        if entry.failed_at is not None and started - entry.failed_at < FAILED_S:
            raise self._load_failed(entry, int(FAILED_S - (started - entry.failed_at)) + 1)
        if entry.loading is None:
            entry.loading = asyncio.ensure_future(self._load(entry))
            entry.loading.add_done_callback(lambda t: t.cancelled() or t.exception())  # told to its callers, if any
        try:
            await asyncio.shield(entry.loading)
        finally:
            if entry.loading is not None and entry.loading.done():
                entry.loading = None
        return time.monotonic() - started

    async def _load(self, entry: ModelEntry) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.load_now, entry)
            try:
                await self.start(entry)
            except BaseException:  # loaded but cannot run: let it go whole
                entry.app = entry.engine = None
                self.device.remove(entry.name)
                raise
        except APIError:  # no room now (429): nothing failed
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to load answers 503, and is not retried at once
            log.error("model %s could not load: %s", entry.name, exc, exc_info=not isinstance(exc, StartupError))
            entry.failed_at = time.monotonic()
            raise self._load_failed(entry, int(FAILED_S)) from None

    def _load_failed(self, entry: ModelEntry, retry_s: int) -> APIError:
        return APIError(503, f"model {entry.name} could not load (the server's log says why); it is tried again "
                             f"after {retry_s} s", type="server_error", code="model_load_failed",
                        headers={"Retry-After": str(retry_s)})

    def retry_after_s(self, entry: ModelEntry) -> int:
        return int(max(1, min(60, round(entry.last_load_s or 1.0))))

    def _busy(self, entry: ModelEntry) -> bool:
        """Requests in flight: routed here and not answered, in its app or engine, or jobs of its own unfinished in
        the state store (queued ones included: they run only while it is loaded). Read from any thread: the app is
        read once, as a drop may clear it meanwhile."""
        from .app import is_idle

        app = entry.app
        if entry.pending or app is None:
            return bool(entry.pending)
        jobs = app.state.server.jobs
        return not is_idle(app) or bool(jobs.store.count_unfinished(jobs.service))

    # --- back to disk ------------------------------------------------------------------------------------------
    def _to_disk(self, name: str) -> None:
        """From the device (any thread): host memory is over budget and `name` is its idle least recently used."""
        entry = self.entries[name]
        if entry.stack is None and entry.loading is None:  # loaded at start-up, not serving yet: let it go now
            entry.app = entry.engine = None
            self.device.remove(name)
            return
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drop(entry)))

    async def drop(self, entry: ModelEntry) -> None:
        """Stop an idle model's app and let its weights go; a request that came meanwhile keeps it (in host
        memory: its next step moves it back)."""
        busy = entry.stack is None or await asyncio.to_thread(self._busy, entry)  # the store may be asked
        if busy or entry.pending or entry.stack is None:  # again: a request may have come while the store answered
            if entry.stack is not None:
                self.device.back_to_host(entry.name)
            return
        stack, entry.stack = entry.stack, None
        entry.app = entry.engine = None
        self.device.remove(entry.name)
        await stack.aclose()
        log.info("model %s went back to disk (host memory over its budget)", entry.name)

    async def close(self) -> None:
        """Stop every model's app (each in turn: one that fails to stop is logged, the others still stop)."""
        try:
            for entry in self.entries.values():
                if entry.stack is not None:
                    stack, entry.stack = entry.stack, None
                    try:
                        await stack.aclose()
                    except Exception:  # noqa: BLE001
                        log.exception("model %s did not stop cleanly", entry.name)
        finally:
            self.device.close()

    def card(self, entry: ModelEntry) -> dict:
        """The model's entry in GET /v1/models: OpenAI's fields, then its family, where it is and what it serves."""
        card = {"id": entry.name, "object": "model", "created": entry.started_at, "owned_by": "stepserve",
                "family": entry.family, "aliases": list(entry.spec.aliases), "default": entry.name == self.default}
        where = self.device.describe(entry.name)
        card["place"] = where.pop("place") if entry.stack is not None or entry.loading is not None else DISK
        card["memory"] = where
        card["loads"] = entry.loads
        if entry.engine is not None:
            card["family"] = entry.engine.model_info.family
            card["serves"] = serves(entry.engine.model_info)
        return card

