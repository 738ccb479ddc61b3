"""What the slo policy's step reads from the waiting queue when deadlines or priorities are in play, without
scanning it: the step's host work does not grow with the queue (scheduling/slo.py's rules are unchanged).

The policy registers three ordered indexes on the engine's WaitingQueue (queue.py, `index`):
- `service`: per bucket, the service order less the starvation rule (priority, then deadline or remaining
  steps, then arrival; constant while a request waits). Requests waiting longer than starvation_s come first by
  arrival: they are a prefix of the bucket's arrival order.
- `giveup`: per (bucket, remaining steps), by deadline. Requests of one group cost the same alone, so only the
  earliest deadlines of each group need a look to find every request that can no longer make it.
- `deadline`: per bucket, by deadline: the tightest deadline of the bucket's queue.

Per bucket the queue also keeps the remaining steps and the non-zero priorities summed. With these a step
reads the running requests, the first requests of the chosen bucket in service order (the slots to fill, then a
horizon of `horizon` more, which the adaptive cap's replay predicts: requests deeper in the queue are judged when
they come nearer), the head of every give-up group, and per other bucket either its requests (up to the horizon)
or its sums (the fluid estimate of its backlog, fleet/work.py). Within the horizon the plans are exactly those of
a full scan.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..fleet.work import bucket_s
from ..request.buckets import Bucket
from ..request.types import Request
from .predict import predict_finish_times
from .queue import WaitingQueue
from .slo_front import EPS_S

SERVICE, GIVEUP, DEADLINE = "slo-service-", "slo-giveup", "slo-deadline"


class Indexed:
    """The queue as one slo step sees it: `dead` are the waiting requests given up this step (still queued
    until the engine removes them), left out of every read."""

    def __init__(self, policy, queue: WaitingQueue, now: float) -> None:
        self.policy, self.queue, self.now = policy, queue, now
        self.dead: set[Request] = set()
        srs = policy.order == "srs"
        queue.index(SERVICE + policy.order, _bucket, lambda r: _static_key(r, srs))
        queue.index(GIVEUP, lambda r: None if r.deadline is None else (r.bucket, r.num_inference_steps - r.step),
                    lambda r: (r.deadline,))
        queue.index(DEADLINE, lambda r: None if r.deadline is None else r.bucket, lambda r: (r.deadline,))

    def hopeless(self) -> list[Request]:
        """Waiting requests that cannot make their deadline even alone (policy.cannot_make_it), by arrival."""
        out, alone, model, now = [], {}, self.policy.latency_model, self.now
        for group in self.queue.groups(GIVEUP):
            top = self.queue.top(GIVEUP, group)
            if top is None:
                continue
            bucket, steps = group
            cost = alone.get(bucket)
            if cost is None:  # predict.earliest_finish's terms, read once per bucket and step
                cost = alone[bucket] = (model.step_s(1, bucket), model.decode_s(1, bucket), model.encode_s(1))
            finish = now + steps * cost[0] + cost[1]
            finish += cost[2]
            if finish <= top.deadline + EPS_S:
                continue  # the group's earliest deadline can be met: so can the rest (same cost, later)
            for r in self.queue.first(GIVEUP, group):
                if not self.policy.cannot_make_it(r, now):
                    break
                out.append(r)
        out.sort(key=self.queue.position)
        self.dead.update(out)
        return out

    def count(self, bucket: Bucket) -> int:
        return self.queue.count(bucket) - sum(1 for r in self.dead if r.bucket == bucket)

    def oldest(self, bucket: Bucket) -> float:
        """Arrival time of the bucket's oldest live waiting request (math.inf: none)."""
        for r in self.queue.head(bucket, len(self.dead) + 1):
            if r not in self.dead:
                return r.arrival_time
        return math.inf

    def order(self, bucket: Bucket, k: int | None) -> list[Request]:
        """The first k live waiting requests of `bucket` in service order (policy._key(now)): the starving ones
        by arrival, then the rest by the service index."""
        starve = self.now - self.policy.starvation_s
        out: list[Request] = []
        if math.isfinite(starve):
            for r in self.queue.head(bucket, None if k is None else k + len(self.dead)):
                if not r.arrival_time < starve or (k is not None and len(out) >= k):
                    break
                if r not in self.dead:
                    out.append(r)
        left = None if k is None else k - len(out)
        if left is None or left > 0:
            skip: Callable[[Request], bool] = lambda r: r in self.dead or r.arrival_time < starve
            out += self.queue.first(SERVICE + self.policy.order, bucket, left, skip)
        return out

    def steps(self, bucket: Bucket, taken: list[Request]) -> int:
        """Remaining steps of the live waiting requests of `bucket` other than `taken`."""
        gone = [r for r in self.dead if r.bucket == bucket] + taken
        return self.queue.steps(bucket) - sum(r.num_inference_steps - r.step for r in gone)

    def loose(self, pool: list[Request], taken: list[Request], rest: int, bucket: Bucket) -> bool:
        """Whether only throughput is at stake (slo.py, "Cost-aware bound"): no priority, and every deadline met even
        one at a time; over the slot holders (`pool`) and the `rest` waiting requests of the bucket that stay
        queued (all but `taken` and the dead), read from the sums and indexes."""
        gone = set(taken) | {r for r in self.dead if r.bucket == bucket}
        if any(r.priority != 0 for r in pool) or self.queue.prioritised(bucket) - sum(
                1 for r in gone if r.priority != 0) > 0:
            return False
        deadlines = [r.deadline for r in pool if r.deadline is not None]
        deadlines += [r.deadline for r in self.queue.first(DEADLINE, bucket, 1, gone.__contains__)]
        if not deadlines:
            return True
        model = self.policy.latency_model
        steps = sum(r.num_inference_steps - r.step for r in pool) + self.steps(bucket, list(taken))
        drained = self.now + steps * model.step_s(1, bucket) + (len(pool) + rest) * model.decode_s(1, bucket)
        return min(deadlines) >= drained

    def backlog_s(self, bucket: Bucket, running: list[Request], horizon: int | None, key) -> float:
        """Seconds of engine time the bucket's work needs alone at the full batch cap; a
        replay of its requests in service order up to the horizon, the fluid estimate (fleet/work.py) past it."""
        policy, waiting = self.policy, self.count(bucket)
        if horizon is None or len(running) + waiting <= horizon:
            pool, rest = policy._service_order(running, self.order(bucket, None), key)
            fins = predict_finish_times(pool + rest, policy.max_batch_size, policy.latency_model, self.now, bucket)
            return max(fins) - self.now
        steps = sum(r.num_inference_steps - r.step for r in running) + self.steps(bucket, [])
        return bucket_s(len(running) + waiting, steps, waiting, bucket, policy.latency_model, policy.max_batch_size)


def _bucket(r: Request) -> Bucket:
    return r.bucket


def _static_key(r: Request, srs: bool) -> tuple:
    """The service key (slo.SLOPolicy._key) less its starvation rule: fixed while `r` waits."""
    if r.deadline is None:
        return (-r.priority, math.inf, math.inf, r.arrival_time)
    return (-r.priority, r.num_inference_steps - r.step if srs else r.deadline, r.deadline, r.arrival_time)
