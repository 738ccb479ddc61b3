"""From a parsed request to engine handles and back: submit n images, wait (watching the client), map outcomes.

Submission is all-or-nothing: every image is validated first, and if the engine refuses one of them (queue full,
shutting down) the ones already queued are aborted, so a 429 leaves nothing behind in the engine.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..api import GenerationResult
from ..async_engine import AsyncEngine, RequestHandle, ShuttingDownError
from ..engine import QueueFullError
from ..types import FinishReason, RequestStatus, SamplingParams
from ..validation import ValidationError, resolve_params
from . import errors
from .errors import APIError
from .metrics import ServerMetrics
from .schemas import ServerLimits

Receive = Callable[[], Awaitable[dict]]
_PARAM_FOR_FIELD = {"height": "size", "width": "size", "params": None}


@dataclass
class ServerState:
    """Everything one app needs; plain data on app.state, no module globals."""

    engine: AsyncEngine
    limits: ServerLimits
    metrics: ServerMetrics
    api_key: str | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))
    inflight: int = 0  # HTTP image requests being served (streams included)
    draining: bool = False
    recent_request_s: float = 1.0  # smoothed engine time per request, for Retry-After

    def note_latency(self, seconds: float) -> None:
        self.recent_request_s = 0.8 * self.recent_request_s + 0.2 * seconds

    def retry_after_s(self) -> int:
        batches_ahead = self.engine.queue_depth / max(1, self.engine.options.max_batch_size) + 1
        return int(min(60, max(1, math.ceil(batches_ahead * self.recent_request_s))))


def preview_steps(num_steps: int, partial_images: int) -> frozenset[int]:
    """`partial_images` evenly spaced steps strictly inside (0, num_steps)."""
    if partial_images <= 0 or num_steps < 2:
        return frozenset()
    steps = {round(num_steps * (i + 1) / (partial_images + 1)) for i in range(partial_images)}
    return frozenset(s for s in steps if 1 <= s < num_steps)


def submit_all(state: ServerState, params: list[SamplingParams], partial_images: int = 0) -> list[RequestHandle]:
    engine = state.engine
    try:
        resolved = [resolve_params(p, engine.model) for p in params]
    except ValidationError as exc:
        param = _PARAM_FOR_FIELD.get(exc.field, exc.field)
        raise errors.invalid(_size_message(exc, engine) if param == "size" else str(exc), param) from None
    max_queue = engine.options.max_queue
    if max_queue is not None and len(resolved) > max_queue:
        raise errors.invalid(f"n: {len(resolved)} images are more than this server queues at once ({max_queue}); "
                             f"ask for at most {max_queue} per request", "n")
    handles: list[RequestHandle] = []
    try:
        for p in resolved:
            handles.append(engine.submit(p, preview_steps=preview_steps(p.num_inference_steps, partial_images)))
    except QueueFullError as exc:
        abort_all(engine, handles)
        raise errors.queue_full(str(exc), state.retry_after_s()) from None
    except ShuttingDownError:
        abort_all(engine, handles)
        raise errors.shutting_down() from None
    except ValidationError as exc:  # the engine re-validates; identical rules, kept for safety
        abort_all(engine, handles)
        raise errors.invalid(str(exc), _PARAM_FOR_FIELD.get(exc.field, exc.field)) from None
    return handles


def _size_message(exc: ValidationError, engine: AsyncEngine) -> str:
    m = engine.model
    return f"size: {exc}; 'auto' gives the model's default {m.default_width}x{m.default_height}"


def abort_all(engine: AsyncEngine, handles: list[RequestHandle]) -> None:
    for h in handles:
        engine.abort(h.request_id)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away (the request body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def backstop_s(params: list[SamplingParams]) -> float | None:
    """How long the HTTP side waits at most. The engine enforces timeout_s itself at step boundaries; this only
    covers a step that overruns the deadline by far."""
    timeout = params[0].timeout_s if params else None
    return None if timeout is None else timeout + max(1.0, 0.25 * timeout)


async def wait_all(state: ServerState, handles: list[RequestHandle], receive: Receive,
                   timeout_s: float | None) -> list[GenerationResult] | None:
    """All results in order, or None when the client disconnected first (its requests are then aborted)."""
    results = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({results, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if results in done:
        return results.result()
    results.cancel()
    abort_all(state.engine, handles)
    if watcher in done:
        return None
    raise errors.deadline_passed(handles[0].params.timeout_s or 0.0)


def check(result: GenerationResult) -> None:
    """Raise the APIError a failed result stands for."""
    if result.status is RequestStatus.COMPLETED:
        return
    reason = result.finish_reason
    if reason is FinishReason.TIMEOUT:
        raise errors.deadline_passed(result.params.timeout_s or 0.0)
    if reason is FinishReason.QUEUE_FULL:
        raise errors.queue_full(result.error or "queue is full", 1)
    if reason in (FinishReason.SHUTTING_DOWN, FinishReason.ABORTED):
        raise errors.shutting_down("the server shut down before this request finished; retry")
    raise errors.model_failure(result.error)


def outcome_of(exc: APIError) -> str:
    return {400: "invalid", 401: "unauthorized", 413: "invalid", 429: "rejected", 503: "shutting_down",
            504: "timeout"}.get(exc.status, "failed")


def png_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


async def encode(image) -> str:
    """PNG + base64; large images off the event loop so other requests keep flowing."""
    if image.width * image.height <= 128 * 128:
        return png_b64(image)
    return await asyncio.to_thread(png_b64, image)


def image_info(result: GenerationResult) -> dict:
    t = result.timing
    return {
        "request_id": result.request_id,
        "seed": result.params.seed,
        "steps": len(t.batch_sizes),
        "num_inference_steps": result.params.num_inference_steps,
        "sampler": result.params.sampler,
        "guidance_scale": result.params.guidance_scale,
        "queue_s": t.queue_s,
        "denoise_s": t.denoise_s,
        "decode_s": t.decode_s,
        "total_s": t.total_s,
        "batch_sizes": list(t.batch_sizes),  # one entry per denoising step: the size of that forward pass
    }


def size_of(params: SamplingParams) -> str:
    return f"{params.width}x{params.height}"
