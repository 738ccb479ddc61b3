"""The policy protocol and helpers shared by the batching policies.

Policies are pure decision makers: no torch, no asyncio, no clock. They are given the waiting queue (in arrival
order), the running set and `now`, and return a StepPlan. The only state they keep is their own bookkeeping.

The engine core hands them its WaitingQueue (queue.py: indexed by bucket and arrival order), so that a step looks
only at the head of each bucket's queue; a plain sequence (tests, a snapshot) is wrapped with `as_queue`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..request.buckets import Bucket
from ..request.types import Request, StepPlan
from .queue import WaitingQueue, as_queue


class Policy(Protocol):
    name: str
    max_batch_size: int

    def schedule(
        self, waiting: Sequence[Request] | WaitingQueue, running: Sequence[Request], now: float, draining: bool = False
    ) -> StepPlan:
        """Decide one engine step. `draining` means no more requests will arrive (offline generate())."""
        ...

    # A policy that predicts with a latency model (slo) also has plan_share(share): on a device shared by several
    # models, the share of it this model gets now, set before each step (device_share.plan_at).


def in_bucket(requests: Sequence[Request], bucket: Bucket) -> list[Request]:
    return [r for r in requests if r.bucket == bucket]


def buckets_by_age(waiting: Sequence[Request] | WaitingQueue) -> list[Bucket]:
    """Buckets that have waiting requests, ordered by their oldest waiting request."""
    if isinstance(waiting, WaitingQueue):
        return waiting.buckets()
    seen: dict[Bucket, None] = {}
    for r in waiting:
        seen.setdefault(r.bucket, None)
    return list(seen)


class RequestLevelPolicy:
    """Shared shape of none/static/dynamic: a batch is formed, then run to the end before the next one forms.

    Items of a batch that need fewer steps finish (and are answered) earlier; nobody joins a batch in flight.
    Subclasses say when a batch of a bucket may start (`ready`) and when to look again (`wake_time`); both are
    given the bucket's oldest waiting requests, at most max_batch_size of them (a batch never takes more), so a
    step costs the same however deep the queue is.
    """

    name = "request-level"
    max_batch_size = 1

    def schedule(
        self, waiting: Sequence[Request] | WaitingQueue, running: Sequence[Request], now: float,
        draining: bool = False
    ) -> StepPlan:
        if running:  # a batch is in flight: it runs to the end, alone
            return StepPlan(run=list(running))
        wake: float | None = None
        queue = as_queue(waiting)
        for bucket in queue.buckets():
            candidates = queue.head(bucket, self.max_batch_size)
            if self.ready(candidates, now, draining):
                return StepPlan(admit=candidates, run=list(candidates))
            t = self.wake_time(candidates)
            if t is not None:
                wake = t if wake is None else min(wake, t)
        return StepPlan(wake_at=wake)

    def ready(self, candidates: list[Request], now: float, draining: bool) -> bool:
        raise NotImplementedError

    def wake_time(self, candidates: list[Request]) -> float | None:
        return None


class BucketTurns:
    """Which shape bucket a step runs, for the step-level policies (continuous, adaptive): among the buckets that
    can run something (running requests, or waiting ones while a slot is free), the least recently run first;
    ties keep running before waiting, then the age of the oldest waiting request. No bucket starves."""

    def __init__(self) -> None:
        self._last_run: dict[Bucket, int] = {}  # bucket -> step counter when it last ran
        self._steps = 0

    def pick(self, running: Sequence[Request], queue, free: int) -> Bucket | None:
        active: dict[Bucket, None] = {}
        for r in running:
            active.setdefault(r.bucket, None)
        if free:
            for b in queue.buckets():  # by their oldest waiting request
                active.setdefault(b, None)
        if not active:
            return None
        bucket = min(active, key=lambda b: self._last_run.get(b, -1))
        self._steps += 1
        self._last_run[bucket] = self._steps
        return bucket

    @property
    def steps(self) -> int:
        return self._steps
