"""The engine thread of the AsyncEngine (async_engine.py): it moves the inbox into the core, steps it, and hands
results and progress events back to the event loop. Everything here runs on that one thread, under the front
end's lock where it touches what callers see (the inbox, the handles)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..parallel.ranks import RanksLost
from ..scheduling.device_share import plan_at
from ..request.types import FinishReason, GenerationResult, Request, RequestStatus, StepReport
from .handles import ProgressEvent, RequestHandle, ended_result, failed_result, post_event, set_result

log = logging.getLogger("stepserve.engine.async_engine")


@dataclass
class _Add:
    handle: RequestHandle
    request: Request  # built and admitted at submit; the engine thread only queues it


@dataclass
class _Abort:
    request_id: str


class EngineThread:
    """The engine thread's half of AsyncEngine (a mixin: the state it reads is made by AsyncEngine.__init__)."""

    def _run(self) -> None:
        try:
            self._loop_body()
        except BaseException as exc:  # noqa: BLE001 - the core's state can no longer be trusted
            self._die(exc)
            return
        finally:
            if self.device is not None:  # a turn handed to it at its last step's end passes on
                self.device.withdraw(self.device_name)
        if self.failure is not None:  # the executor failed between steps (a rank died): its pending were answered
            log.critical("the engine thread stopped: %s", self.failure)

    def _loop_body(self) -> None:
        core = self.core
        while not self._stop and self.failure is None:  # a failed executor (a rank died) runs no other step
            self._drain_inbox()
            if not core.has_work():
                if self.device is not None:
                    self.device.withdraw(self.device_name)
                self._sleep(0.5)
                continue
            report = self._step()
            if self.failure is not None:  # the executor failed during the step: its pending were answered
                return
            self.running_count = len(core.running) + len(core.to_decode)
            self._publish(report)
            self._notify(report)
            if report.batch_size == 0 and not report.finished and not report.admitted:
                self._sleep(0.5 if report.wake_at is None else max(0.0, report.wake_at - self.clock.now()))

    def _step(self) -> StepReport:
        """One step of the core; on a device shared with other models (engine/device.py), inside this model's turn
        (bidding its most urgent deadline), with the model moved onto the device first and its policy planning at
        the share of the device it gets now."""
        if self.device is None:
            return self.core.step(self.clock.now())
        core = self.core
        with self.device.turn(self.device_name, core.earliest_deadline()) as took:
            plan_at(core.policy, self.device.share_now(self.device_name))  # slo plans at its share
            report = core.step(self.clock.now())
            # more to do at once (not a policy's wait): bid for the next step now, as the device frees
            again = report.duration_s > 0 and core.has_work() and not self._stop and self.failure is None
            took(report.duration_s, again, core.earliest_deadline() if again else None)
        return report

    def _sleep(self, timeout: float) -> None:
        self._wake.wait(timeout)
        self._wake.clear()

    def _drain_inbox(self) -> None:
        """Move the inbox into the core. Holding the lock throughout keeps queue_depth exact (no request is in
        neither place), which is what makes admission one decision."""
        with self._lock:
            items, self._inbox = self._inbox, []
            for item in items:
                if isinstance(item, _Abort):
                    self.core.abort(item.request_id)
                else:
                    self._add_to_core(item)

    def _add_to_core(self, item: _Add) -> None:
        try:
            self.core.enqueue(item.request)
        except Exception as exc:  # noqa: BLE001 - never dropped: anything here fails this one request
            self._log_once("add", "could not queue request %s", item.request.request_id, exc_info=exc)
            message = f"could not queue the request: {type(exc).__name__}: {exc}"
            self._resolve_locked(failed_result(item.handle, message))
            return
        self.adapter_gate.track([item.request])  # only a queued request carries its adapters

    def _publish(self, report: StepReport) -> None:
        with self._lock:  # one pass under the lock per step, not one per request
            for r in report.finished:
                self._resolve_locked(r)
            streams = [(r, h) for r in report.progressed if not r.is_finished
                       and (h := self._handles.get(r.request_id)) is not None and h.stream]
        for r, handle in streams:
            preview = None
            if r.step in handle.preview_steps:
                try:
                    preview = self.executor.preview(r)
                except Exception as exc:  # noqa: BLE001 - a preview is optional; never fail the request for it
                    self._log_once("preview", "preview failed; the stream goes on without it", exc_info=exc)
            self._call(post_event, handle._events, ProgressEvent(r.request_id, r.step, r.num_inference_steps, preview))

    def _notify(self, report: StepReport) -> None:
        for callback in self.on_step:
            try:
                callback(report)
            except Exception as exc:  # noqa: BLE001 - an observer's bug must not stop the engine
                name = getattr(callback, "__qualname__", repr(callback))
                self._log_once(f"on_step:{name}", "on_step callback %s failed; the engine serves on", name,
                               exc_info=exc, level=logging.ERROR)

    def _resolve_locked(self, r: Request) -> None:
        handle = self._handles.pop(r.request_id, None)
        if handle is not None:
            self._deliver(handle, GenerationResult.from_request(r))

    def _deliver(self, handle: RequestHandle, result: GenerationResult) -> None:
        self._call(set_result, handle._future, result)
        if handle._events is not None:
            self._call(handle._events.put_nowait, result)

    def _die(self, exc: BaseException) -> None:
        said = self.failure is not None  # the executor said first (a parallel model's rank died): logged there
        if not said:
            self.failure = f"{type(exc).__name__}: {exc}"
        self.accepting = False
        if said:
            log.critical("the engine thread stopped: %s", self.failure)
        else:
            log.critical("the engine thread stopped after an internal error; failing every pending request",
                         exc_info=exc)
        if said or isinstance(exc, RanksLost):  # a rank's pids and traceback stay in the log
            message = "a rank of this model failed (the server's log says which and why); this server cannot run " \
                      "another step until it is restarted"
        else:
            message = f"internal engine error: {self.failure}"
        self._end_pending(RequestStatus.FAILED, FinishReason.ERROR, message)

    def _end_pending(self, status: RequestStatus, reason: FinishReason, message: str) -> None:
        """Answer every pending handle now (the engine thread died, or shutdown gave up waiting for a step): none
        is left waiting, and whatever the engine thread reports later for them finds no handle."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
            self._inbox = []
        for h in handles:
            self._deliver(h, ended_result(h, status, reason, message))

    def _call(self, fn, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed in between: nobody is left to tell
            pass

    def _log_once(self, kind: str, message: str, *args: Any, exc_info: BaseException | None = None,
                  level: int = logging.WARNING) -> None:
        if kind in self._logged_kinds:
            return
        self._logged_kinds.add(kind)
        log.log(level, message + " (logged once)", *args, exc_info=exc_info)
