"""What the slo policy tells the front end before a request is queued: whether to admit it (admission), whether
it could ever meet its deadline (infeasible), when to retry (retry_after_s), and predicted finish times
(predict). The rules are in scheduling/slo.py's docstring ("Admission"); these methods only read the policy's
state, so a front end may call them outside the engine loop on a snapshot of its queues."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from ..costs.latency_model import Bucket
from ..request.types import Request
from ..util.words import duration
from .predict import earliest_finish, interleave, predict_finish_times

# Float rounding between a prediction and the engine's own sums: a prediction must beat a deadline by this much
# to count as meeting it, and miss it by this much before a request is given up.
EPS_S = 1e-9


class SLOFrontEnd:
    """The front-end half of SLOPolicy (scheduling/slo.py), which provides max_batch_size, latency_model, _key,
    _service_order, _meets and the grouping of requests by bucket."""

    def admission(
        self, request: Request, waiting: Iterable[Request], running: Sequence[Request], now: float
    ) -> str | None:
        """Why `request` should be refused now (None: admit). Requests without a deadline are always admitted,
        without reading `waiting` (which may be a one-pass iterable)."""
        if request.deadline is None:
            return None
        never = self.infeasible(request, now)
        if never is not None:
            return never
        waiting = [r for r in list(waiting) if r is not request]  # one copy (list() reads it in one go)
        running = [r for r in running if r is not request]
        # steady state: the bucket's batch does not shrink below its present size (freed slots are refilled)
        floor = len([r for r in list(running) + waiting if r.bucket == request.bucket]) + 1
        before = self.predict(waiting, running, now, floor_batch=floor)
        after = self.predict(waiting + [request], running, now, floor_batch=floor)
        mine = after[id(request)]
        if not self._meets(mine, request):
            return (f"deadline cannot be met under the current load: predicted to finish in {duration(mine - now)}, "
                    f"{deadline_words(request, now)}")
        hurt = [r for r in list(running) + waiting
                if self._meets(before[id(r)], r) and not self._meets(after[id(r)], r)]
        if hurt:
            return f"admitting it would make {len(hurt)} admitted request(s) miss their deadline"
        return None

    def infeasible(self, request: Request, now: float) -> str | None:
        """Why `request` can never meet its deadline, even alone on an idle engine (None: it could). Unlike a
        refusal under load, retrying cannot help."""
        if request.deadline is None:
            return None
        # alone on the whole device: a device shared with other models (latency_model.share) is a load, not a limit
        alone = earliest_finish(request, self.latency_model.whole_device(), now)
        if alone <= request.deadline + EPS_S:
            return None
        return (f"deadline cannot be met: it needs at least {duration(alone - now)} even alone, and "
                f"{deadline_words(request, now)}")

    def retry_after_s(self, waiting: Sequence[Request], running: Sequence[Request], now: float,
                      bucket: Bucket | None = None) -> float:
        """Predicted seconds until the requests in the engine (of `bucket`, if given) are fewer than
        max_batch_size, i.e. until a new request would get a slot without queueing. 0 when one is free now."""
        if bucket is not None:
            waiting = [r for r in waiting if r.bucket == bucket]
            running = [r for r in running if r.bucket == bucket]
        finish = sorted(self.predict(waiting, running, now).values())
        k = len(finish) - self.max_batch_size
        return 0.0 if k < 0 else max(finish[k] - now, 0.0)

    # --- predictions -------------------------------------------------------------------------------------------
    def predict(self, waiting: Sequence[Request], running: Sequence[Request], now: float,
                floor_batch: int = 1) -> dict[int, float]:
        """Predicted finish time of every request, keyed by id(request): per bucket a replay at the full batch
        cap in service order, stretched by the other buckets' backlogs (predict.interleave). With `floor_batch`,
        every step is charged as at least that batch (slots that free up are expected to be refilled)."""
        key = self._key(now)
        alone: dict[Bucket, tuple[list[Request], list[float]]] = {}
        for b, (run_b, wait_b) in _by_bucket(running, waiting).items():
            pool, rest = self._service_order(run_b, wait_b, key)
            order = pool + rest
            alone[b] = (order, predict_finish_times(order, self.max_batch_size, self.latency_model, now, b,
                                                    floor_batch=floor_batch))
        backlog = {b: max(f) - now for b, (_, f) in alone.items()}
        out: dict[int, float] = {}
        for b, (order, fins) in alone.items():
            others = [w for o, w in backlog.items() if o != b]
            for r, f in zip(order, fins):
                out[id(r)] = now + interleave(f - now, others)
        return out


Group = tuple[list[Request], list[Request]]  # (running, waiting) of one bucket


def _by_bucket(running: Sequence[Request], waiting: Sequence[Request]) -> dict[Bucket, Group]:
    """Requests grouped by bucket as (running, waiting), buckets ordered by their oldest request's arrival."""
    groups: dict[Bucket, Group] = {}
    oldest: dict[Bucket, float] = {}
    for i, r in enumerate(list(running) + list(waiting)):
        groups.setdefault(r.bucket, ([], []))[0 if i < len(running) else 1].append(r)
        oldest[r.bucket] = min(oldest.get(r.bucket, math.inf), r.arrival_time)
    return {b: groups[b] for b in sorted(groups, key=oldest.__getitem__)}


def deadline_words(request: Request, now: float) -> str:
    """"its deadline is in 10 ms", and where the engine keeps time before it to send the answer, how timeout_s
    became that (a timeout_s no larger than the margin leaves no time at all)."""
    text = f"its deadline is in {duration(request.deadline - now)}"
    timeout_s = request.params.timeout_s
    margin = None if timeout_s is None else request.arrival_time + timeout_s - request.deadline
    if margin is not None and margin > 1e-6:
        text += f" (timeout_s {duration(timeout_s)}, less {duration(margin)} kept to send the answer)"
    return text
