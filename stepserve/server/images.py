"""The images endpoint's per-request work (POST /v1/images/generations), in the order a request meets it: admission of all n images in one decision, waiting for the results while watching the client, what
each result means in HTTP terms, and the PNG of each image.

app.py routes a request through these; streaming.py sends the same results as server-sent events.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
import time
from collections.abc import Awaitable, Callable, Sequence

from ..addons.errors import AddonError
from ..api import GenerationResult
from ..engine.async_engine import AsyncEngine, EngineDeadError, RequestHandle, ShuttingDownError
from ..engine.admission_errors import AdmissionError, DeadlineInfeasibleError, DeadlineRefusedError
from ..request.types import FinishReason, RequestStatus, SamplingParams
from ..request.validation import SizeError, ValidationError, resolve_params
from . import errors
from .errors import APIError

from .state import ServerState

# Admission: from parsed request parameters to engine handles, all n images in one decision or none.

# a problem of the parameters together names no one body field; the edit form's field for the engine's mask_image
_PARAM_FOR_FIELD = {"params": None, "mask_image": "mask"}


def preview_steps(num_inference_steps: int, partial_images: int) -> frozenset[int]:
    """`partial_images` evenly spaced steps strictly inside (0, num_inference_steps)."""
    if partial_images <= 0 or num_inference_steps < 2:
        return frozenset()
    steps = {round(num_inference_steps * (i + 1) / (partial_images + 1)) for i in range(partial_images)}
    return frozenset(s for s in steps if 1 <= s < num_inference_steps)


async def resolve_all(state: ServerState, params: Sequence[SamplingParams]) -> list:
    """Every image checked against the model (defaults filled in, a seed drawn where none was given), or the 400 the
    first bad one stands for; a group larger than the queue could ever hold is a 400 too."""
    engine = state.engine
    try:
        await engine.resolve_adapters(params)  # adapters registered through another replica: looked up once
        resolved = [resolve_params(p, engine.model_info) for p in params]
    except SizeError as exc:  # the caller sent one "size", not a height and a width
        raise errors.invalid(_size_message(exc, engine), "size") from None
    except ValidationError as exc:
        param = _PARAM_FOR_FIELD.get(exc.field, exc.field)
        message = str(exc) if param in (None, exc.field) else f"{param}{str(exc)[len(exc.field):]}"
        raise errors.invalid(message, param) from None
    max_queue = engine.options.max_queue
    if max_queue is not None and len(resolved) > max_queue:
        raise errors.invalid(f"n: {len(resolved)} images are more than this server queues at once ({max_queue}); "
                             f"ask for at most {max_queue} per request", "n")
    return resolved


async def submit_all(state: ServerState, params: Sequence[SamplingParams], partial_images: int = 0,
                     stream: bool = False) -> list[RequestHandle]:
    """Validate every image, then admit the group atomically: a 429 leaves nothing of it in the engine. An
    admission rule that replays the queue (slo) runs off the event loop."""
    engine = state.engine
    resolved = await resolve_all(state, params)
    previews = [preview_steps(p.num_inference_steps, partial_images) for p in resolved]
    try:
        return await engine.submit_many_off_loop(resolved, previews, stream=stream)
    except ValidationError as exc:  # a LoRA adapter deleted since it was checked above
        raise errors.invalid(str(exc), exc.field) from None
    except AddonError as exc:  # adapters that cannot load now (429) or ever (400), as a ControlNet's answer
        raise errors.addon_failure(exc) from None
    except DeadlineInfeasibleError as exc:  # even alone it would be late: a retry can never succeed
        raise errors.invalid(f"timeout_s: {exc}; raise timeout_s (or ask for fewer steps)", "timeout_s",
                             "deadline_infeasible") from None
    except AdmissionError as exc:
        reason = "deadline" if isinstance(exc, DeadlineRefusedError) else "queue_full"
        state.metrics.refused_at_admission.labels(reason).inc()
        retry = state.retry_after_s() if exc.retry_after_s is None else max(1, math.ceil(exc.retry_after_s))
        if reason == "deadline":
            raise errors.deadline_refused(str(exc), retry) from None
        raise errors.queue_full(str(exc), retry) from None
    except ShuttingDownError:
        raise errors.shutting_down() from None
    except EngineDeadError as exc:
        raise errors.engine_failed(str(exc)) from None


def _size_message(exc: SizeError, engine: AsyncEngine) -> str:
    """A wrong width or height, told as the "size" the caller sent (WIDTHxHEIGHT)."""
    m = engine.model_info
    return f"size: {exc.about_size()}; 'auto' gives the model's default {m.default_width}x{m.default_height}"


def abort_all(engine: AsyncEngine, handles: Sequence[RequestHandle]) -> None:
    for h in handles:
        engine.abort(h.request_id)


# Waiting for the results while watching the client: a client that goes away aborts its requests in the engine.

Receive = Callable[[], Awaitable[dict]]


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away (the request body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def backstop_s(params: Sequence[SamplingParams]) -> float | None:
    """How long the HTTP side waits at most. The engine enforces timeout_s itself (it wakes at deadlines); this
    only covers a step that overruns the deadline by far."""
    timeout = params[0].timeout_s if params else None
    return None if timeout is None else timeout + max(1.0, 0.25 * timeout)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def wait_all(state: ServerState, handles: list[RequestHandle], receive: Receive,
                   timeout_s: float | None) -> list[GenerationResult] | None:
    """All results in order, or None when the client disconnected first (its requests are then aborted). When
    the waiting task itself is cancelled (Ray Serve cancels it when the client goes away, uvicorn at shutdown) or
    anything else interrupts the wait, the requests are aborted too: cancelled means aborted."""
    results = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
    results.add_done_callback(_retrieve)  # once cancelled, its CancelledError is nobody's to read: no log noise
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({results, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # asyncio.CancelledError included
        results.cancel()
        abort_all(state.engine, handles)
        raise
    finally:
        watcher.cancel()
    if results in done:
        return results.result()
    results.cancel()
    abort_all(state.engine, handles)
    if watcher in done:
        return None
    raise errors.deadline_passed(handles[0].params.timeout_s or 0.0, "the engine did not answer in time")


# From engine results to HTTP: the error each failed result stands for, the metrics outcome of each error, and the
# per-image details that ride along in responses.


def check(result: GenerationResult) -> None:
    """Raise the APIError a failed result stands for."""
    if result.status is RequestStatus.COMPLETED:
        return
    reason = result.finish_reason
    if reason is FinishReason.TIMEOUT:
        raise errors.deadline_passed(result.params.timeout_s or 0.0, result.error)
    if reason is FinishReason.QUEUE_FULL:
        raise errors.queue_full(result.error or "queue is full", 1)
    if reason is FinishReason.DEADLINE_INFEASIBLE:
        raise errors.deadline_refused(result.error or "deadline cannot be met", 1)
    if reason is FinishReason.ABORTED:  # the client's own aborts are never answered; these are shutdown aborts
        raise errors.shutting_down("the server shut down before this request finished; retry")
    if isinstance(result.cause, AddonError):  # an add-on's error: the request's own (400) or a held budget (429)
        raise errors.addon_failure(result.cause)
    raise errors.model_failure(result.error)


def outcome_of(exc: APIError) -> str:
    return {400: "invalid", 401: "unauthorized", 403: "unauthorized", 413: "invalid", 415: "invalid",
            429: "rejected", 503: "shutting_down", 504: "timeout"}.get(exc.status, "failed")


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
        "cache": _cache_text(result.params.cache),
        "cached_steps": t.cached_steps,  # steps that reused cached work instead of the whole denoiser
        "loras": [{"name": n, "scale": s} for n, s in result.params.loras or ()],
        "controls": [{"name": c.name, "scale": c.scale, "start": c.start, "end": c.end, "guess_mode": c.guess_mode}
                     for c in getattr(result.params, "controls", None) or ()],
        "ip_adapter": _image_prompt(getattr(result.params, "ip_adapter", None)),
        "strength": result.params.strength,  # image to image (/v1/images/edits); null for a generation
    }


def _image_prompt(prompts) -> dict | list | None:
    """A request's image prompts: one object, or a list of them for several adapters."""
    if not prompts:
        return None
    out = [{"name": p.name, "scale": p.scale} for p in prompts]
    return out[0] if len(out) == 1 else out


def _cache_text(spec) -> dict | None:
    """The request's resolved CacheSpec as JSON (its knobs that are set), or None when it did not cache."""
    if spec is None or isinstance(spec, (str, dict)):
        return spec
    return {k: v for k, v in vars(spec).items() if v is not None}


def size_of(params: SamplingParams) -> str:
    return f"{params.width}x{params.height}"


async def image_body(state: ServerState, results: Sequence[GenerationResult]) -> dict:
    """The answer to an images request whose images all completed (an async job's `result` is the same)."""
    return {
        "created": int(time.time()),
        "data": [{"b64_json": await encode(r.image)} for r in results],
        "size": size_of(results[0].params),
        "output_format": "png",
        "stepserve": {"model": state.engine.model_info.name, "images": [image_info(r) for r in results]},
    }


# PNG + base64 encoding of response images.


def png_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


async def encode(image) -> str:
    """Large images are encoded off the event loop so other requests keep flowing."""
    if image.width * image.height <= 128 * 128:
        return png_b64(image)
    return await asyncio.to_thread(png_b64, image)
