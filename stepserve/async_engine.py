"""The async front of the engine: one EngineCore stepped by one background thread, asyncio callers around it.

Callers submit (validation and the queue bound are checked at once, in the caller's thread), then await the
result or iterate progress events. Cancellation is a message: abort(request_id) reaches the core before its next
step, which frees the slot. New requests and aborts cross threads through an inbox; results and events go back
to the event loop with call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .api import EngineOptions, GenerationResult
from .clock import WallClock
from .engine import QueueFullError
from .executor.base import Executor
from .types import FinishReason, Request, RequestStatus, SamplingParams, StepReport, next_request_id
from .validation import resolve_params


class ShuttingDownError(RuntimeError):
    """The engine no longer accepts requests."""


@dataclass
class ProgressEvent:
    request_id: str
    step: int  # denoising steps done
    num_steps: int
    preview: Any = None  # a PIL image of the current latents, at the steps the caller asked previews for


@dataclass
class RequestHandle:
    request_id: str
    params: SamplingParams  # resolved
    preview_steps: frozenset[int] = frozenset()
    _future: asyncio.Future = field(default=None, repr=False)  # type: ignore[assignment]
    _events: asyncio.Queue = field(default=None, repr=False)  # type: ignore[assignment]

    async def result(self) -> GenerationResult:
        return await asyncio.shield(self._future)

    async def events(self) -> AsyncIterator[ProgressEvent | GenerationResult]:
        """Progress events, then the final GenerationResult."""
        while True:
            item = await self._events.get()
            yield item
            if isinstance(item, GenerationResult):
                return


class AsyncEngine:
    def __init__(self, executor: Executor, **options: Any) -> None:
        self.executor = executor
        self.options = EngineOptions(**options)
        self.core = self.options.make_core(executor)
        self.clock = WallClock()
        self.accepting = True
        self.on_step: list[Callable[[StepReport], None]] = []  # called in the engine thread after every step
        self._inbox: list[tuple[str, Any]] = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self.running_count = 0  # requests admitted and not finished (updated after every step)

    @property
    def model(self):
        return self.executor.model

    @property
    def queue_depth(self) -> int:
        with self._inbox_lock:
            pending = sum(1 for kind, _ in self._inbox if kind == "add")
        return len(self.core.waiting) + pending

    # --- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="stepserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop accepting; let in-flight work finish within grace_s; then abort what is left and stop."""
        self.accepting = False
        deadline = self.clock.now() + grace_s
        while self._handles and self.clock.now() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._handles):
            self.abort(rid)
        while self._handles and self._thread is not None and self._thread.is_alive():
            await asyncio.sleep(0.01)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # --- requests ----------------------------------------------------------------------------------------------
    def submit(self, params: SamplingParams, request_id: str | None = None,
               preview_steps: frozenset[int] = frozenset()) -> RequestHandle:
        """Queue a request. Raises ValidationError (bad input), QueueFullError, ShuttingDownError at once."""
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")
        resolved = resolve_params(params, self.model)
        max_queue = self.options.max_queue
        if max_queue is not None and self.queue_depth >= max_queue:
            raise QueueFullError(f"queue is full ({max_queue} waiting); retry later")
        assert self._loop is not None, "call start() first"
        handle = RequestHandle(request_id or next_request_id(), resolved, frozenset(preview_steps),
                               self._loop.create_future(), asyncio.Queue())
        self._handles[handle.request_id] = handle
        self._send("add", (handle, self.clock.now()))
        return handle

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def _send(self, kind: str, payload: Any) -> None:
        with self._inbox_lock:
            self._inbox.append((kind, payload))
        self._wake.set()

    # --- engine thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while not self._stop:
            self._drain_inbox()
            if not core.has_work():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            report = core.step(self.clock.now())
            self.running_count = len(core.running)
            self._publish(report)
            for callback in self.on_step:
                callback(report)
            if report.batch_size == 0 and not report.finished and not report.admitted:
                timeout = 0.5 if report.wake_at is None else max(0.0, report.wake_at - self.clock.now())
                self._wake.wait(timeout)
                self._wake.clear()

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, []
        for kind, payload in items:
            if kind == "abort":
                self.core.abort(payload)
                continue
            handle, arrival = payload
            try:
                self.core.add_request(handle.params, arrival, request_id=handle.request_id,
                                      preview_steps=handle.preview_steps)
            except QueueFullError as exc:  # lost a race for the last queue place: rejected, never dropped
                self._resolve(exc.request)
            except Exception as exc:  # noqa: BLE001 - validation already passed; anything else fails this one
                r = Request(handle.request_id, handle.params, arrival, (0, 0), 0, status=RequestStatus.FAILED,
                            finish_reason=FinishReason.ERROR, error=str(exc))
                self._resolve(r)

    def _publish(self, report: StepReport) -> None:
        for r in report.progressed:
            handle = self._handles.get(r.request_id)
            if handle is None or r.is_finished:
                continue
            preview = None
            if r.step in handle.preview_steps:
                try:
                    preview = self.executor.preview(r)
                except Exception:  # noqa: BLE001 - a preview is optional; never fail the request for it
                    preview = None
            event = ProgressEvent(r.request_id, r.step, r.num_steps, preview)
            self._call(handle._events.put_nowait, event)
        for r in report.finished:
            self._resolve(r)

    def _resolve(self, r: Request) -> None:
        handle = self._handles.pop(r.request_id, None)
        if handle is None:
            return
        result = GenerationResult.from_request(r)
        self._call(_set_result, handle._future, result)
        self._call(handle._events.put_nowait, result)

    def _call(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)
