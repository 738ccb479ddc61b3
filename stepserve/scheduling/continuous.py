"""Continuous (iteration-level) batching.

At every denoising step: pick a shape bucket, admit waiting requests of that bucket into the free slots (first
come first served), and run one step for every running request of the bucket. A request that finishes leaves at
once (the engine retires it), so its slot is free for the next step.

Slots are counted over all buckets: at most max_batch_size requests are running (encoded, latents in memory) at
once, those of the buckets that are not run in this step included. So the memory a running request holds is
bounded by max_batch_size whatever the mix of sizes (the memory cap measures max_batch_size requests).

With several buckets, the bucket to run is chosen round-robin among the buckets that can run something (running
requests, or waiting ones while a slot is free), least recently run first, so that no bucket starves: a bucket
that only waits takes the next slot that frees.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..request.buckets import Bucket
from .base import BucketTurns, in_bucket
from .queue import WaitingQueue, as_queue
from ..request.types import Request, StepPlan


class ContinuousBatchingPolicy:
    name = "continuous"

    def __init__(self, max_batch_size: int) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self._turns = BucketTurns()

    def schedule(
        self, waiting: Sequence[Request] | WaitingQueue, running: Sequence[Request], now: float,
        draining: bool = False
    ) -> StepPlan:
        free = max(self.max_batch_size - len(running), 0)  # slots are shared by all buckets
        queue = as_queue(waiting)
        bucket = self._turns.pick(running, queue, free)
        if bucket is None:
            return StepPlan()
        joining = queue.head(bucket, free)
        return self.step_plan(bucket, in_bucket(running, bucket), joining, queue.count(bucket) - len(joining))

    def step_plan(self, bucket: Bucket, holders: list[Request], joining: list[Request],
                  queued: int = 0) -> StepPlan:
        """The step for the bucket picked: its slot holders and the waiting requests the free slots admit, all
        of them (a cost-aware subclass runs fewer: scheduling/adaptive.py). `queued`: the bucket's requests that
        stay waiting for a slot."""
        return StepPlan(admit=joining, run=holders + joining)
