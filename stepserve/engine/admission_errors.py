"""Why a request was refused at admission (never queued): what EngineCore.add_request / check_admission raise and
the front ends turn into HTTP 429 (retry later) or 400 (it can never be met)."""

from __future__ import annotations

from ..request.types import Request


class AdmissionError(RuntimeError):
    """The request was refused at admission and never queued; the caller should retry later (HTTP 429)."""

    def __init__(self, message: str, request: Request | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.request = request  # in its final state (REJECTED) when it was created at all
        self.retry_after_s = retry_after_s  # the policy's estimate of when a slot frees, when it has one


class QueueFullError(AdmissionError):
    """The waiting queue is at max_queue."""


class DeadlineRefusedError(AdmissionError):
    """The policy predicts the request cannot meet its deadline (timeout_s) under the current load."""


class DeadlineInfeasibleError(DeadlineRefusedError):
    """The request cannot meet its deadline even alone on an idle engine: a retry can never succeed (HTTP 400)."""
