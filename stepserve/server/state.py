"""The state one app holds (plain data on app.state, no module globals) and its Retry-After estimate."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..async_engine import AsyncEngine
from .metrics import ServerMetrics
from .schemas import ServerLimits


@dataclass
class ServerState:
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
        """Whole seconds until a place is likely to free up: the batches queued ahead times a recent request's
        time, between 1 and 60."""
        batches_ahead = self.engine.queue_depth / max(1, self.engine.options.max_batch_size) + 1
        return int(min(60, max(1, math.ceil(batches_ahead * self.recent_request_s))))
