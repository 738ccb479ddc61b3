"""The async front of the engine: one EngineCore stepped by one background thread, asyncio callers around it.

Callers submit (validation and admission are decided at once; the server's submit_many_off_loop moves a costly
decision, and one that waits for a LoRA adapter, onto threads of the engine's own: off_loop.py), then await the
result or, for a streaming submit, iterate progress events. Cancellation is a message: abort(request_id) reaches
the core before its next step, which frees the slot. New requests and aborts cross threads through an inbox; results and
events go back to the event loop with call_soon_threadsafe.

Admission is one atomic decision: a request counts against `max_queue` from the moment it is accepted until it
leaves the waiting queue, and the engine thread moves requests from the inbox into the core under the same lock
that submit() checks the bound under. So a full queue is refused at submit (429 at once), never later.

The engine thread's side (the inbox into the core, steps, results back to the loop) is in engine_thread.py.

Failures: an executor error fails only the requests of that stage (inside the core); a policy error fails the
requests it was deciding about (inside the core); a failing on_step callback is logged and the engine serves on.
Anything else that escapes the core means its state can no longer be trusted: the engine thread fails every
pending request with the error, marks the engine unhealthy (`failure`) and refuses new work.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..executor.base import Executor
from ..addons.store import Holder
from ..lora.errors import LoraBudgetError, LoraError, LoraTooLargeError
from ..lora.gate import AdapterGate, Deletion
from ..request.types import FinishReason, Request, RequestStatus, SamplingParams, StepReport, next_request_id
from ..request.validation import ValidationError
from .clock import WallClock
from .config import EngineOptions, options_from
from .engine_thread import EngineThread, _Abort, _Add
from .handles import EngineDeadError, ProgressEvent, RequestHandle, ShuttingDownError
from .off_loop import OffLoop

__all__ = ["AsyncEngine", "DEFAULT_ANSWER_MARGIN_S", "EngineDeadError", "ProgressEvent", "RequestHandle",
           "ShuttingDownError"]

log = logging.getLogger(__name__)

# An answer needs a moment to cross from the engine thread to the caller's event loop: deadlines keep this much
# slack (EngineOptions.answer_margin_s) unless the caller sets its own (the HTTP server adds encoding and sending).
DEFAULT_ANSWER_MARGIN_S = 0.005


@contextlib.contextmanager
def _adapter_errors() -> Iterator[None]:
    """The adapter gate's errors: a memory held by adapters in use (retry later) and an adapter larger than the
    whole memory stay the add-on errors they are (addons/errors.py: the same answers as ControlNets' and
    IP-Adapters'); any other adapter that cannot be served is the request's own bad input."""
    try:
        yield
    except (LoraBudgetError, LoraTooLargeError):
        raise
    except LoraError as exc:
        raise ValidationError("loras", str(exc)) from None


class AsyncEngine(EngineThread):
    def __init__(self, executor: Executor, join_timeout_s: float = 10.0, options: EngineOptions | None = None,
                 device: Any = None, device_name: str = "", **overrides: Any) -> None:
        """`device`: an engine/device.py SharedDevice when this model shares its device with others (a server of
        several models): each step then waits for this model's turn, as `device_name`."""
        self.executor = executor
        self.device, self.device_name = device, device_name
        if options is None:
            overrides.setdefault("answer_margin_s", DEFAULT_ANSWER_MARGIN_S)
        self.options = options_from(options, overrides)
        self.core = self.options.make_core(executor)
        self.clock = WallClock()
        self.accepting = True
        self.on_step: list[Callable[[StepReport], None]] = []  # called in the engine thread after every step
        self.join_timeout_s = join_timeout_s
        self.failure: str | None = None  # why the engine thread died; None while healthy
        self._running = 0  # requests admitted and not finished (updated after every step)
        self._lock = threading.Lock()  # guards _inbox, _handles and the admission decision
        self._inbox: list[_Add | _Abort] = []
        # LoRA loading and deletion; the adapters of requests in the inbox are in use as those of queued ones
        self.adapter_gate = AdapterGate(executor, self._lock, lambda: [i.request for i in self._inbox
                                                                       if isinstance(i, _Add)])
        self._off_loop = OffLoop()  # threads of its own for admission decisions and adapter loads
        self._handles: dict[str, RequestHandle] = {}
        self._wake = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._logged_kinds: set[str] = set()
        # an executor over several ranks tells at once when one dies (stepserve/parallel): fail what is pending
        getattr(executor, "on_failure", []).append(self._executor_failed)

    @property
    def model_info(self):
        return self.executor.model_info

    @property
    def healthy(self) -> bool:
        return self.failure is None

    def _close_executor(self) -> None:
        """Stop what the executor runs beside this process (a parallel model's worker ranks)."""
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()

    def _executor_failed(self, why: str) -> None:
        """From the executor's watcher thread: the model cannot run another step. Unhealthy now, every pending
        request answered with why, nothing new accepted; the engine thread ends at its next step."""
        self.failure = why
        self.accepting = False
        # the details (pids, a worker's traceback) go to the log, as /health keeps them; clients hear what happened
        self._end_pending(RequestStatus.FAILED, FinishReason.ERROR,
                          "a rank of this model failed (the server's log says which and why); this server cannot "
                          "run another step until it is restarted")
        self._wake.set()

    @property
    def running_count(self) -> int:
        """Requests admitted and not finished; none once the engine failed (they were answered, and nothing runs:
        a draining server waits for nothing)."""
        return 0 if self.failure is not None else self._running

    @running_count.setter
    def running_count(self, n: int) -> None:
        self._running = n

    @property
    def queue_depth(self) -> int:
        """Requests accepted and not yet admitted into a batch (inbox included); none once the engine failed (they
        were answered, and the core that still lists them runs no other step)."""
        if self.failure is not None:
            return 0
        with self._lock:
            return self._queued_locked()

    def _queued_locked(self) -> int:
        return len(self.core.waiting) + sum(1 for item in self._inbox if isinstance(item, _Add))

    # --- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="stepserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, grace_s: float = 30.0) -> bool:
        """Stop accepting; let in-flight work finish within grace_s; then abort what is left and stop.
        Returns whether the engine thread really ended (it is logged when it did not)."""
        self.accepting = False
        deadline = self.clock.now() + grace_s
        while self._pending() and self.clock.now() < deadline and self._alive():
            await asyncio.sleep(0.02)
        with self._lock:
            left = list(self._handles)
        for rid in left:
            self.abort(rid)
        abort_deadline = self.clock.now() + self.join_timeout_s
        while self._pending() and self._alive() and self.clock.now() < abort_deadline:
            await asyncio.sleep(0.01)
        self._stop = True
        self._wake.set()
        self._off_loop.close()
        if self._thread is None:
            self._close_executor()
            return True
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, self.join_timeout_s)
        await asyncio.get_running_loop().run_in_executor(None, self._close_executor)
        if self._thread.is_alive():
            log.warning("the engine thread did not stop within %.1f s of shutdown (a step is still running); "
                        "answering its %d pending request(s) as shut down", self.join_timeout_s, self._pending())
            self._end_pending(RequestStatus.CANCELLED, FinishReason.ABORTED,
                              "the server shut down before this request finished")
            return False
        return True

    def _pending(self) -> int:
        with self._lock:
            return len(self._handles)

    def _alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --- requests ----------------------------------------------------------------------------------------------
    def submit(self, params: SamplingParams, request_id: str | None = None,
               preview_steps: frozenset[int] = frozenset(), stream: bool = False) -> RequestHandle:
        """Queue a request. Raises ValidationError (bad input), QueueFullError, ShuttingDownError or
        EngineDeadError at once."""
        return self.submit_many([params], [preview_steps], stream=stream,
                                request_ids=None if request_id is None else [request_id])[0]

    def submit_many(self, params: Sequence[SamplingParams], preview_steps: Sequence[frozenset[int]] | None = None,
                    stream: bool = False, request_ids: Sequence[str] | None = None) -> list[RequestHandle]:
        """Queue a group of requests all or none: every one is validated, then admitted in one decision (the queue
        bound and the policy's admission rule, each member counting the ones before it), so a refusal leaves
        nothing of the group behind. Raises the AdmissionError of the first member refused. Call it on the event
        loop's thread; `submit_many_off_loop` does the same with the admission decision on a worker thread."""
        assert self._loop is not None, "call start() first"
        return self._admit(self._new_group(params, preview_steps, request_ids), self._outlets(len(params), stream),
                           stream)

    async def submit_many_off_loop(self, params: Sequence[SamplingParams],
                                   preview_steps: Sequence[frozenset[int]] | None = None, stream: bool = False,
                                   request_ids: Sequence[str] | None = None) -> list[RequestHandle]:
        """submit_many, but the event loop never waits: a policy with an admission rule of its own (slo replays
        the queue: its cost grows with the queue) decides on a thread of the engine's own, and a group whose
        adapters must be loaded first (or while a load or delete holds the adapter gate) is admitted on the
        adapter thread. When the caller is cancelled meanwhile, what the admission accepted is aborted."""
        assert self._loop is not None, "call start() first"
        off = self._off_loop
        self._check_open()  # a draining or dead engine loads nothing for a request it then refuses
        await self.resolve_adapters(params)
        preloading = Holder()  # from before their load until the requests hold them (none unloaded in between)
        self._hold_addons(preloading, params)
        try:
            await self.preload_addons(params)
            group = self._new_group(params, preview_steps, request_ids)
            for r in group:  # each request holds its ControlNets and IP-Adapters until it ends
                self._hold_addons(r, [r.params])
            outlets = self._outlets(len(params), stream)  # futures are made on the loop's thread
            if getattr(self.core.policy, "admission", None) is None:
                handles = self._admit(group, outlets, stream, wait=False)
            else:
                handles = await off.run(off.decisions, self._admit, group, outlets, stream, False,
                                        undo=self._abort_all)
            if handles is None:  # it waits for the adapter gate
                handles = await off.run(off.adapters, self._admit, group, outlets, stream, True,
                                        undo=self._abort_all)
            return handles
        finally:
            self._release_addons(preloading)

    def _hold_addons(self, owner, params: Sequence[SamplingParams]) -> None:
        from ..controls import serving as controls
        from ..ipadapter import serving as image_prompts

        controls.hold(self.executor, owner, params)
        image_prompts.hold(self.executor, owner, params)

    def _release_addons(self, owner) -> None:
        from ..controls import serving as controls
        from ..ipadapter import serving as image_prompts

        controls.release(self.executor, owner)
        image_prompts.release(self.executor, owner)

    def _abort_all(self, handles: list[RequestHandle]) -> None:
        for h in handles:
            self.abort(h.request_id)

    def _new_group(self, params: Sequence[SamplingParams], preview_steps: Sequence[frozenset[int]] | None,
                   request_ids: Sequence[str] | None) -> list[Request]:
        self._check_open()
        previews = list(preview_steps) if preview_steps is not None else [frozenset()] * len(params)
        ids = list(request_ids) if request_ids is not None else [next_request_id() for _ in params]
        now = self.clock.now()
        # bad input fails here, before anything is decided
        return [self.core.new_request(p, now, rid, frozenset(pv)) for p, rid, pv in zip(params, ids, previews)]

    def _outlets(self, n: int, stream: bool) -> list[tuple[asyncio.Future, asyncio.Queue | None]]:
        assert self._loop is not None
        return [(self._loop.create_future(), asyncio.Queue() if stream else None) for _ in range(n)]

    def _admit(self, group: list[Request], outlets: list, stream: bool,
               wait: bool = True) -> list[RequestHandle] | None:
        """Admit `group` (all or none). With wait=False it returns None instead of waiting for the adapter gate."""
        self._check_open()  # before any adapter is loaded for it
        with _adapter_errors(), self.adapter_gate.admitting(group, wait) as entered:
            if not entered:
                return None
            with self._lock:
                self._check_open()
                ahead = [item.request for item in self._inbox if isinstance(item, _Add)]
                self.adapter_gate.check(group)
                for i, request in enumerate(group):
                    self.core.check_admission(request, request.arrival_time, ahead + group[:i])  # raises for all
                handles = []
                for request, (future, events) in zip(group, outlets):
                    h = RequestHandle(request.request_id, request.params, request.arrival_time,
                                      request.preview_steps, stream, future, events)
                    self._handles[h.request_id] = h
                    self._inbox.append(_Add(h, request))
                    handles.append(h)
        self._wake.set()
        return handles

    async def load_adapter(self, name: str, path) -> Any:
        """Load LoRA adapter file `path` as `name` on the adapter thread (stepserve/lora/gate.py). Raises
        stepserve.lora.LoraError."""
        return await self._off_loop.run(self._off_loop.adapters, self.adapter_gate.load, name, path)

    async def resolve_adapters(self, params: Sequence[SamplingParams]) -> None:
        """Before validation: the LoRA adapters these requests name that this engine does not serve yet are looked
        up once (the adapter store's resolver: registrations made on another replica), on the adapter thread; the
        ones found become servable. Nothing to do (and no thread) when every name is known or there is no
        resolver. Raises ValidationError for a registration this engine cannot serve (its file is missing here)."""
        unknown = self.adapter_gate.unknown(params)
        if unknown:
            with _adapter_errors():
                await self._off_loop.run(self._off_loop.adapters, self.adapter_gate.resolve, unknown)

    async def preload_addons(self, params: Sequence[SamplingParams]) -> None:
        """The ControlNets and IP-Adapters these requests name that are not loaded are loaded now, on the adapter
        thread, before the requests are queued: a first load (gigabytes from disk) never runs inside a step, on the
        engine thread with the executor's lock held (controls/serving.py, ipadapter/serving.py). `params` as
        resolved or as sent. Nothing to do (and no thread) when every one is loaded or none is named."""
        from ..controls import serving as controls
        from ..ipadapter import serving as image_prompts

        names = controls.to_load(self.executor, params)
        if names:
            await self._off_loop.run(self._off_loop.adapters, controls.load, self.executor, names)
        try:
            controls.check_depths(self.executor, params)  # else the request would fail at its first step
        except ValueError as exc:  # ControlNetError: the request's own bad input
            raise ValidationError(getattr(exc, "param", "controls"), str(exc)) from None
        groups = image_prompts.to_load(self.executor, params)  # each request's adapters, loaded together
        if groups:
            await self._off_loop.run(self._off_loop.adapters, image_prompts.load, self.executor, groups)

    async def register_adapter(self, name: str, path) -> bool:
        """Serve LoRA adapter file `path` as `name` from now on, loaded on first use (an adapter registered on
        another replica), on the adapter thread. Raises stepserve.lora.LoraError."""
        return await self._off_loop.run(self._off_loop.adapters, self.adapter_gate.register, name, path)

    async def delete_adapter(self, name: str, wait_s: float = 60.0) -> Deletion:
        """Unload LoRA adapter `name` while serving (stepserve/lora/gate.py). Raises stepserve.lora.LoraError."""
        return await self.adapter_gate.delete(name, lambda fn, *args: self._off_loop.run(self._off_loop.adapters,
                                                                                          fn, *args), wait_s)

    def _check_open(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(f"the engine stopped after an internal error and serves no more requests: "
                                  f"{self.failure}")
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(_Abort(request_id))
        self._wake.set()
