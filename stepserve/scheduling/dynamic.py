"""Dynamic batching as in Triton: start a batch when max_batch_size requests of one shape are waiting, or when
the oldest of them has waited max_queue_delay. The batch then runs start to finish; arrivals wait for the next.
"""

from __future__ import annotations

from .base import RequestLevelPolicy
from ..request.types import Request


class DynamicBatchingPolicy(RequestLevelPolicy):
    name = "dynamic"

    def __init__(self, max_batch_size: int, max_queue_delay_s: float) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_queue_delay_s < 0:
            raise ValueError(f"max_queue_delay_ms must be >= 0, got {max_queue_delay_s * 1000:g}")
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s

    def ready(self, candidates: list[Request], now: float, draining: bool) -> bool:
        if not candidates:
            return False
        if len(candidates) >= self.max_batch_size:
            return True
        # Offline generate(): every request is in, waiting longer cannot fill the batch further.
        return draining or now >= self.wake_time(candidates)

    def wake_time(self, candidates: list[Request]) -> float:
        return candidates[0].arrival_time + self.max_queue_delay_s
