"""Static batching: wait for exactly N requests of one shape, then run them start to finish together.

A partial batch runs only when the oldest request has waited `flush_timeout_s` (so nobody waits forever when
traffic stops) or when the caller says no more requests will come (`draining`, offline generate()).
"""

from __future__ import annotations

from .base import RequestLevelPolicy
from ..request.types import Request

DEFAULT_FLUSH_TIMEOUT_S = 2.0


class StaticBatchingPolicy(RequestLevelPolicy):
    name = "static"

    def __init__(self, batch_size: int, flush_timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S) -> None:
        if batch_size < 1:
            raise ValueError(f"static_batch_size must be >= 1, got {batch_size}")
        if flush_timeout_s is not None and flush_timeout_s < 0:
            raise ValueError(f"flush_timeout_s must be >= 0 or None (never flush), got {flush_timeout_s}")
        self.max_batch_size = batch_size
        self.flush_timeout_s = flush_timeout_s

    def ready(self, candidates: list[Request], now: float, draining: bool) -> bool:
        if len(candidates) >= self.max_batch_size:
            return True
        if not candidates:
            return False
        if draining:
            return True
        t = self.wake_time(candidates)
        return t is not None and now >= t

    def wake_time(self, candidates: list[Request]) -> float | None:
        if self.flush_timeout_s is None or not candidates:
            return None
        return candidates[0].arrival_time + self.flush_timeout_s
