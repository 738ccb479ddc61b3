"""From engine results to HTTP: the error each failed result stands for, the metrics outcome of each error, and
the per-image details that ride along in responses."""

from __future__ import annotations

from ..api import GenerationResult
from ..types import FinishReason, RequestStatus, SamplingParams
from . import errors
from .errors import APIError


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
    raise errors.model_failure(result.error)


def outcome_of(exc: APIError) -> str:
    return {400: "invalid", 401: "unauthorized", 413: "invalid", 429: "rejected", 503: "shutting_down",
            504: "timeout"}.get(exc.status, "failed")


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
