"""`GET /v1/engine/events`: the engine's steps as a live Server-Sent Events stream, for the web console.

Each engine step becomes one compact record, built once in the engine thread and handed to every viewer:

    {"t": 12.345,            # seconds since the server started, when the step began
     "dt": 0.031,            # how long the step took (encode + denoise + decode)
     "rows": [[7, 3, 20]],   # requests that took a denoising step: [short id, steps done, steps in all]
     "joined": [7],          # requests admitted at this step
     "paused": [4],          # running requests that did not step (their bucket waited its turn)
     "done": [[5, "completed", 1.234, 20]],  # finished: [id, status, latency from arrival (s), steps]
     "queue": 3, "running": 6, "cap": 4}     # queue depth, requests admitted, the batch cap in force (or null)

A Ray Serve replica's records also carry `"replica": "<its id>"`, and their `t` counts from the start of the hub
that merges all replicas' records (ray/fleet_events.py). On a server of several models (one device shared step by
step, engine/device.py) each model's app has a stream of its own (`?model=NAME` at the front, server/dispatch.py):
its records carry `"model": "<its name>"`, its hello names the model as requests do, and every model's `t` counts
from one origin per device, so the console can lay the models' steps side by side on one time line (which model
held the device at each step: a step's `t` is when its turn began, `dt` how long it held the device).

Short ids are small integers, given to a request the first time a record names it (per replica, per model). Records
reach the viewers in batches, FLUSH_S apart: one wake-up of the event loop per batch, not per step (each `event:
steps` carries a JSON list of records, in order). A viewer that reads too slowly loses the oldest batches, never
blocks the engine. While no viewer is connected no record is built: the hub subscribes to the engine's steps when
the first viewer arrives and leaves with the last; all it does meanwhile is remember the last finished requests
(status, latency, steps) in `remember`, one append per finished request. On connect a viewer first gets `event:
hello` with the model (its sizes and defaults), the batch bound and those recent finished requests (for the latency
view), then `event: steps`, each a JSON list of step records in order. At most MAX_VIEWERS streams at once
(viewers.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import weakref
from collections import deque

from ..request.types import StepReport
from .viewers import Viewers

RECENT = 500  # finished requests remembered for a viewer that connects later
FLUSH_S = 0.1  # records reach the viewers in batches this far apart (10 a second: enough for a live picture)
_ORIGINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a shared device -> its models' common `t` origin
_ORIGINS_LOCK = threading.Lock()  # models load in worker threads, possibly two at once


def _origin(engine) -> float:
    """Where `t` counts from: now, or for a model on a shared device the device's origin (made with its first
    model's stream), so that the steps of models loaded at different times share one time line."""
    device = getattr(engine, "device", None)
    if device is None:
        return time.monotonic()
    with _ORIGINS_LOCK:
        return _ORIGINS.setdefault(device, time.monotonic())


class EngineEvents:
    def __init__(self, engine, started: float | None = None) -> None:
        self.engine = engine
        self.started = _origin(engine) if started is None else started
        self.label: str | None = None  # a Ray Serve replica's id: every record then names it
        # the model's name on a shared device (what requests call it): every record then names it
        self.model: str | None = engine.device_name if getattr(engine, "device", None) is not None else None
        self._recent: deque[list] = deque(maxlen=RECENT)
        self._viewers = Viewers()
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}
        self._next = itertools.count(1)
        self._attached = False
        self._pending: list[str] = []  # records built since the last flush (engine thread -> event loop)
        self._flush_due = False
        engine.on_step.append(self.remember)

    # --- the engine thread ---------------------------------------------------------------------------------------
    def remember(self, report: StepReport) -> None:
        """Always on: the last finished requests, [status, latency from arrival (s) or None, steps]."""
        if report.finished:
            with self._lock:
                self._recent.extend([r.status.value, _latency(r), r.num_inference_steps] for r in report.finished)

    def on_step(self, report: StepReport) -> None:
        if report.duration_s == 0 and not report.finished:
            return  # an idle step
        line = json.dumps(self.record(report), separators=(",", ":"))
        with self._lock:
            self._pending.append(line)
            if self._flush_due:
                return
            loop = self._viewers.loop()
            if loop is None:
                return
            self._flush_due = True
        loop.call_soon_threadsafe(loop.call_later, FLUSH_S, self._flush)

    def _flush(self) -> None:
        """(the event loop) Every record since the last flush, to every viewer as one batch."""
        with self._lock:
            lines, self._pending, self._flush_due = self._pending, [], False
        if lines:
            self._viewers.offer(("steps", "[" + ",".join(lines) + "]"))

    def record(self, report: StepReport) -> dict:
        stepped = {r.request_id for r in report.progressed}
        core = self.engine.core
        record = {"t": round(report.now - self.started, 4), "dt": round(report.duration_s, 4),
                  "rows": [[self._id(r.request_id), r.step, r.num_inference_steps] for r in report.progressed],
                  "joined": [self._id(r.request_id) for r in report.admitted],
                  "paused": [self._id(r.request_id) for r in core.running if r.request_id not in stepped],
                  "done": [[self._id(r.request_id), r.status.value, _latency(r), r.num_inference_steps]
                           for r in report.finished],
                  "queue": len(core.waiting), "running": len(core.running), "cap": self._cap(report)}
        if self.label is not None:
            record["replica"] = self.label
        if self.model is not None:
            record["model"] = self.model
        for r in report.finished:  # after every mention above: a request may step and finish in one step
            self._ids.pop(r.request_id, None)
        return record

    def _cap(self, report: StepReport) -> int | None:
        """The batch cap in force for the step's bucket: a cost-aware policy's own, else the engine's bound."""
        caps = getattr(self.engine.core.policy, "cap", None)
        if caps and report.progressed:
            return caps.get(report.progressed[0].bucket)
        return self.engine.options.max_batch_size

    def _id(self, request_id: str) -> int:
        short = self._ids.get(request_id)
        if short is None:
            short = self._ids[request_id] = next(self._next)
        return short

    # --- viewers (the event loop) --------------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        """A new viewer's queue (APIError 429 past MAX_VIEWERS); the first one attaches to the engine's steps."""
        queue = self._viewers.add()
        with self._lock:
            if not self._attached:
                self._ids.clear()  # ids of requests that finished unwatched
                self.engine.on_step.append(self.on_step)
                self._attached = True
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        left = self._viewers.remove(queue)
        with self._lock:
            if not left:
                self._pending = []
            if not left and self._attached:
                self.engine.on_step.remove(self.on_step)
                self._attached = False

    def close(self) -> None:
        """End every viewer's stream (any thread): the server is draining."""
        self._viewers.close()

    @property
    def closed(self) -> bool:
        return self._viewers.closed

    @property
    def viewers(self) -> int:
        return len(self._viewers)

    def hello(self) -> dict:
        with self._lock:
            recent = list(self._recent)
        info = self.engine.model_info
        model = {"name": info.name, "family": info.family, "default_width": info.default_width,
                 "default_height": info.default_height, "min_size": info.min_size, "max_size": info.max_size,
                 "size_multiple": info.size_multiple, "samplers": list(info.samplers),
                 "default_sampler": info.default_sampler, "default_steps": info.default_steps,
                 "max_steps": info.max_steps, "default_guidance_scale": info.default_guidance_scale,
                 "max_guidance_scale": info.max_guidance_scale, "negative_prompt": info.negative_prompt,
                 "controlnets": sorted(info.control_names), "ip_adapters": sorted(info.ip_adapter_names)}
        if self.model is not None:  # the engine knows its model by its folder's name; requests by the served one
            model["name"] = self.model
        return {"model": model, "max_batch_size": self.engine.options.max_batch_size,
                "strategy": self.engine.core.policy.name, "recent": recent,
                "t": round(time.monotonic() - self.started, 4)}

    def chunks(self, queue: asyncio.Queue):
        """The SSE body for the viewer of `queue` (from subscribe): hello, then step records. The response
        unsubscribes it when the stream ends."""
        async def hello() -> dict:
            return self.hello()

        return self._viewers.stream(queue, hello)


def _latency(r) -> float | None:
    return None if r.timing.finished is None else round(r.timing.finished - r.timing.arrival, 4)
