"""From parsed request parameters to engine handles: all n images are admitted in one decision, or none."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..async_engine import AsyncEngine, EngineDeadError, RequestHandle, ShuttingDownError
from ..engine import AdmissionError, DeadlineRefusedError
from ..types import SamplingParams
from ..validation import ValidationError, resolve_params
from . import errors
from .state import ServerState

_PARAM_FOR_FIELD = {"height": "size", "width": "size", "params": None}


def preview_steps(num_steps: int, partial_images: int) -> frozenset[int]:
    """`partial_images` evenly spaced steps strictly inside (0, num_steps)."""
    if partial_images <= 0 or num_steps < 2:
        return frozenset()
    steps = {round(num_steps * (i + 1) / (partial_images + 1)) for i in range(partial_images)}
    return frozenset(s for s in steps if 1 <= s < num_steps)


def submit_all(state: ServerState, params: Sequence[SamplingParams], partial_images: int = 0,
               stream: bool = False) -> list[RequestHandle]:
    """Validate every image, then admit the group atomically: a 429 leaves nothing of it in the engine."""
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
    previews = [preview_steps(p.num_inference_steps, partial_images) for p in resolved]
    try:
        return engine.submit_many(resolved, previews, stream=stream)
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


def _size_message(exc: ValidationError, engine: AsyncEngine) -> str:
    m = engine.model
    return f"size: {exc}; 'auto' gives the model's default {m.default_width}x{m.default_height}"


def abort_all(engine: AsyncEngine, handles: Sequence[RequestHandle]) -> None:
    for h in handles:
        engine.abort(h.request_id)
