"""What the load generator sends to: an in-process AsyncEngine (one per contender), a server over HTTP, or a Triton
Inference Server over KServe v2 (triton_target.py).

A target answers each request with a Reply: how it ended and, when the server says, where the time went.
Times are on time.monotonic(), the clock of both the event loop and the engine.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..fleet.headers import work_headers
from ..scheduling import DEFAULT_MAX_QUEUE_DELAY_MS
from ..request.types import FinishReason, RequestStatus
from .logs import warn_once
from .workload import RequestSpec

log = logging.getLogger(__name__)

# How a request ended, as the load generator saw it. TIMEOUT: the target gave up on it at its deadline (the engine's
# FinishReason.TIMEOUT, HTTP 504 for a request that carried timeout_s); FAILED: any other failure.
OK, REJECTED, FAILED, TIMEOUT, UNFINISHED = "ok", "rejected", "failed", "timeout", "unfinished"
IMAGES_PATH = "/v1/images/generations"
EDITS_PATH = "/v1/images/edits"


@dataclass
class Reply:
    status: str  # ok | rejected | failed | timeout
    queue_s: float | None = None
    first_step_s: float | None = None  # arrival -> first denoising step done
    denoise_s: float | None = None
    decode_s: float | None = None
    batch_sizes: list[int] = field(default_factory=list)  # size of every forward this request took part in
    cached_steps: int = 0  # steps that reused cached work (step caching), when the target says
    error: str | None = None
    reason: str | None = None  # why a request was refused or failed, when the target says (e.g. queue_full)
    image: Any = None  # kept only when the target was asked to (sample sheets)


@dataclass
class StepSample:
    """One engine step as the engine reported it (in-process targets only)."""

    t: float  # monotonic time the step started
    duration_s: float  # time inside the executor
    batch_size: int  # requests in the denoising forward (0 = no forward)


@dataclass(frozen=True)
class Contender:
    """One strategy with its settings; dynamic at several delays makes several contenders."""

    strategy: str
    max_batch_size: int = 8
    max_queue_delay_ms: float = DEFAULT_MAX_QUEUE_DELAY_MS
    static_batch_size: int | None = None
    max_queue: int | None = None
    slo_order: str | None = None  # slo: its order within a priority (None: EngineOptions' default)
    label: str | None = None  # a name of its own (a second copy of a contender, as a control); None: from settings

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        if self.strategy == "dynamic":
            return f"dynamic({self.max_queue_delay_ms:g}ms)"
        if self.strategy == "static" and self.static_batch_size:
            return f"static({self.static_batch_size})"
        if self.strategy == "slo" and self.slo_order:
            return f"slo({self.slo_order})"
        return self.strategy

    def engine_options(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "max_batch_size": self.max_batch_size,
                "max_queue_delay_ms": self.max_queue_delay_ms, "static_batch_size": self.static_batch_size,
                "max_queue": self.max_queue, **({"slo_order": self.slo_order} if self.slo_order else {})}


class Target(Protocol):
    name: str

    async def start(self) -> None: ...

    async def send(self, spec: RequestSpec) -> Reply: ...

    async def stop(self) -> None: ...

    def step_samples(self) -> list[StepSample]: ...

    async def busy_seconds(self) -> float | None:
        """Cumulative time the engine spent inside executor steps, when the target can say."""
        ...


class EngineTarget:
    """A fresh AsyncEngine around a shared executor; the model is loaded once for all contenders.

    `latency_model`: what an slo contender predicts with (a LatencyModel, measured once for all of them); the
    other strategies do not use one and are not given it."""

    def __init__(self, executor, contender: Contender, keep_images: bool = False, latency_model=None) -> None:
        self.executor = executor
        self.contender = contender
        self.name = contender.name
        self.keep_images = keep_images
        self.latency_model = latency_model
        self.engine = None
        self._steps: list[StepSample] = []
        self._busy = 0.0

    async def start(self) -> None:
        from ..engine.async_engine import AsyncEngine

        options = self.contender.engine_options()
        if self.latency_model is not None and self.contender.strategy == "slo":
            options["latency_model"] = self.latency_model
        self.engine = AsyncEngine(self.executor, **options)
        self.engine.on_step.append(self._record)
        await self.engine.start()

    def _record(self, report) -> None:  # engine thread; list.append is atomic
        self._busy += report.duration_s
        if report.duration_s > 0:
            self._steps.append(StepSample(report.now, report.duration_s, report.batch_size))

    async def send(self, spec: RequestSpec) -> Reply:
        from ..engine.admission_errors import AdmissionError

        try:
            handle = self.engine.submit(spec.to_params())
        except AdmissionError as exc:  # queue full, or (slo) predicted to miss its deadline
            request = getattr(exc, "request", None)
            reason = getattr(getattr(request, "finish_reason", None), "value", None)
            return Reply(REJECTED, error=str(exc), reason=reason or type(exc).__name__)
        try:
            result = await handle.result()
        except asyncio.CancelledError:
            self.engine.abort(handle.request_id)  # the caller gave up: free the slot
            raise
        return reply_of(result, self.keep_images)

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown(grace_s=5.0)

    def step_samples(self) -> list[StepSample]:
        return list(self._steps)

    async def busy_seconds(self) -> float | None:
        return self._busy


def reply_of(finished, keep_image: bool = False) -> Reply:
    """A finished request as the load generator sees it: `finished` is the engine's Request or the async engine's
    result for it (both carry status, finish_reason, error, timing and image)."""
    t = finished.timing
    reason = getattr(finished.finish_reason, "value", None)
    if finished.status is RequestStatus.REJECTED:
        return Reply(REJECTED, error=finished.error, reason=reason)
    if finished.status is not RequestStatus.COMPLETED:
        status = TIMEOUT if finished.finish_reason is FinishReason.TIMEOUT else FAILED
        return Reply(status, error=finished.error or finished.status.value, reason=reason)
    first = None if t.first_step_done is None else t.first_step_done - t.arrival
    return Reply(OK, queue_s=t.queue_s, first_step_s=first, denoise_s=t.denoise_s, decode_s=t.decode_s,
                 batch_sizes=list(t.batch_sizes), cached_steps=t.cached_steps,
                 image=finished.image if keep_image else None)


class HttpTarget:
    """POST /v1/images/generations on a running server (OpenAI images shape plus stepserve's fields); an edit
    request goes to /v1/images/edits as multipart/form-data."""

    def __init__(self, url: str, name: str | None = None, api_key: str | None = None,
                 busy_metric: str = "stepserve_step_latency_seconds_sum", say_work: bool = True) -> None:
        base = url.rstrip("/")
        if base.endswith(IMAGES_PATH):
            base = base[: -len(IMAGES_PATH)]
        self.base = base
        self.name = name or base
        self.api_key = api_key
        self.busy_metric = busy_metric
        self.say_work = say_work  # send each request's steps and size in headers, for a fleet's router
        self._session = None

    async def start(self) -> None:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=None))

    async def send(self, spec: RequestSpec) -> Reply:
        import aiohttp

        if spec.edit is None:
            path, body = IMAGES_PATH, {"json": spec.to_http()}
        else:
            path, body = EDITS_PATH, {"data": _edit_form(spec)}
        try:
            async with self._session.post(self.base + path, headers=self._work(spec), **body) as resp:
                text = await resp.text()
                if resp.status == 429:
                    return Reply(REJECTED, error=_error_message(text), reason=_error_code(text))
                if resp.status == 504 and spec.timeout_s is not None:  # gave up at the deadline we sent
                    return Reply(TIMEOUT, error=f"HTTP 504: {_error_message(text)}", reason=_error_code(text))
                if resp.status != 200:
                    return Reply(FAILED, error=f"HTTP {resp.status}: {_error_message(text)}",
                                 reason=_error_code(text))
                import json

                return reply_from_body(json.loads(text))
        except aiohttp.ClientError as exc:
            return Reply(FAILED, error=f"{type(exc).__name__}: {exc}")

    def _work(self, spec: RequestSpec) -> dict[str, str]:
        return work_headers(spec.num_inference_steps, spec.width, spec.height) if self.say_work else {}

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()

    def step_samples(self) -> list[StepSample]:
        return []

    async def busy_seconds(self) -> float | None:
        """The server's busy time from its /metrics, or None when it cannot say (the metric is optional)."""
        import aiohttp

        try:
            async with self._session.get(self.base + "/metrics") as resp:
                if resp.status != 200:
                    log.debug("%s/metrics answered HTTP %d: no busy time", self.base, resp.status)
                    return None
                for line in (await resp.text()).splitlines():
                    name, _, value = line.partition(" ")
                    if name == self.busy_metric:
                        return float(value)
        except (aiohttp.ClientError, ValueError) as exc:  # unreachable / cut off, or not a number
            warn_once(log, f"busy time not read from {self.base}/metrics: its utilisation is left out", exc)
        return None


def _edit_form(spec: RequestSpec):
    import aiohttp

    from .edits import edit_form

    fields, files = edit_form(spec)
    form = aiohttp.FormData()
    for name, value in fields.items():
        form.add_field(name, value)
    for name, data in files.items():
        form.add_field(name, data, filename=f"{name}.png", content_type="image/png")
    return form


def _error_message(text: str) -> str:
    import json

    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):  # not JSON, or not the OpenAI error shape: show the text itself
        return text[:200]


def _error_code(text: str) -> str | None:
    """The OpenAI error shape's "code" (stepserve: queue_full, deadline_infeasible, deadline_exceeded, ...)."""
    import json

    try:
        code = json.loads(text)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return None if code is None else str(code)


def _seconds(info: dict[str, Any], name: str) -> float | None:
    if info.get(f"{name}_s") is not None:
        return float(info[f"{name}_s"])
    if info.get(f"{name}_ms") is not None:
        return float(info[f"{name}_ms"]) / 1000.0
    return None


def reply_from_body(body: dict[str, Any]) -> Reply:
    """A 200 response; the optional "stepserve" field carries the timing breakdown (per image, under "images")."""
    info = body.get("stepserve") or {}
    if isinstance(info.get("images"), list) and info["images"]:
        info = {**info, **info["images"][0]}
    if isinstance(info.get("timing"), dict):
        info = {**info, **info["timing"]}
    first = _seconds(info, "first_step") or _seconds(info, "time_to_first_step")
    sizes = info.get("batch_sizes") or []
    return Reply(OK, queue_s=_seconds(info, "queue"), first_step_s=first, denoise_s=_seconds(info, "denoise"),
                 decode_s=_seconds(info, "decode"), batch_sizes=[int(s) for s in sizes],
                 cached_steps=int(info.get("cached_steps") or 0))
