"""Continuous (iteration-level) batching.

At every denoising step: pick a shape bucket, admit waiting requests of that bucket into its free slots (up to
max_batch_size, first come first served), and run one step for every running request of the bucket. A request
that finishes leaves at once (the engine retires it), so its slot is free for the next step.

With several buckets, the bucket to run is chosen round-robin among buckets that have work, least recently run
first, so that no bucket starves.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import in_bucket
from ..types import Request, StepPlan


class ContinuousBatchingPolicy:
    name = "continuous"

    def __init__(self, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self._last_run: dict[tuple[int, int], int] = {}  # bucket -> step counter when it last ran
        self._steps = 0

    def schedule(
        self, waiting: Sequence[Request], running: Sequence[Request], now: float, draining: bool = False
    ) -> StepPlan:
        active: dict[tuple[int, int], None] = {}
        for r in list(running) + list(waiting):
            active.setdefault(r.bucket, None)
        if not active:
            return StepPlan()
        # Least recently run first; ties keep the order of `active` (running before waiting, then by age).
        bucket = min(active, key=lambda b: self._last_run.get(b, -1))
        self._steps += 1
        self._last_run[bucket] = self._steps
        run = in_bucket(running, bucket)
        free = self.max_batch_size - len(run)
        admit = in_bucket(waiting, bucket)[: max(free, 0)]
        return StepPlan(admit=admit, run=run + admit)
