"""SLO-aware, cost-aware continuous batching: deadlines first, predicted with a latency model. The default
strategy (scheduling.DEFAULT_STRATEGY).

Continuous batching (requests join and leave at any step) with these rules, each decided from `now` and a
LatencyModel alone:

- Service order. Requests waiting longer than `starvation_s` come first, oldest first (so a low priority is
  never starved). Then higher `priority` first. Within a priority, the requests with a deadline: earliest
  deadline first, or with order="srs" fewest remaining steps first (deadline, then arrival, break ties); then
  those without one, in arrival order (first come first served, which keeps the tail shortest where the
  cost-aware cap runs one at a time).
- Slots. At most `max_batch_size` requests hold a slot (are running: encoded, latents in memory), counted over
  all buckets (the paused ones of the buckets not run in a step included), so the memory cap's measurement at
  max_batch_size holds whatever the mix of sizes. The slots are shared by the buckets with work, max-min
  fairly by their demand (running + waiting; older work first on ties), so that buckets can still take turns.
  Free slots within its share go to waiting requests of the bucket run, in service order; a bucket that only
  waits is not picked while it has no room. A running request is never evicted: it may pause (adaptive cap), and it
  ends early only when it can no longer make its deadline (give up).
- Adaptive cap. The forward batch takes the first `cap` slot holders in service order; the others pause for this
  step. `cap` is the largest batch size <= max_batch_size at which every request of the bucket (slot holders
  and queue) with a deadline is predicted to meet it (predict.py replays the schedule). When no size saves them
  all, the size that saves the most (the larger on a tie).
- Cost-aware bound. The cap is at most what the step-time curve says pays (scheduling/adaptive.py,
  cost_aware_cap: 1 where a batch of n costs about n steps of one, every candidate where batching is cheap, and a
  probe of one more or one fewer now and then), the curve a prior (the latency model) corrected online by the
  steps the executor reports (`observe`). `cost_aware=False` turns it off.
- Give up. A request that would miss its deadline even alone at batch size 1 from now is returned in
  StepPlan.give_up; the engine ends it with a timeout error. Nothing else is ever given up.
- Buckets. Requests of different shapes never share a forward. The bucket to run is chosen by deficit
  round-robin on step cost: every bucket with work earns the same quantum per step and running a step charges
  its bucket the predicted step cost, and the bucket with the largest deficit runs (ties: the bucket whose work
  is oldest). Since the quantum is common to all buckets it does not change which is largest, so only the
  charges are kept; a bucket that runs out of work forgets its deficit, and a bucket that gets work joins level
  with the leader. Expensive and cheap shapes so get equal shares of engine time.
- Admission (called by the front end for each arrival, before queueing): a request with a deadline is refused
  when it is predicted to miss it under the current load, or when admitting it would make a request that is
  predicted to meet its deadline miss it. Requests without a deadline are always admitted. Predictions for
  admission use the full max_batch_size and share the engine between buckets as the round-robin does
  (predict.interleave). The replay assumes a steady state: the bucket's batch does not shrink below its present
  size (its requests, running and queued, plus the newcomer), because under load every slot that frees up is
  refilled by a new arrival. So a request is admitted only if it can make its deadline at the batch size the
  engine is running at, not at the smaller batch a replay without future arrivals would see as others finish.
  Without this, a long request admitted in a lull later holds the batch small (the cap protects it) and turns
  away many cheaper requests (simulated, 8/20/40 steps at 1.5x capacity: goodput 0.81x -> 1.09x of capacity).
  It is an estimate, not a promise: it cannot see later arrivals that go ahead by deadline or priority, nor the
  lower caps chosen later; with exact costs and heavy overload, the tests' traces miss about 2% of the deadlines
  admission accepted. retry_after_s() says when a slot is predicted to free.

Cost (same measurement as predict.py, 200 requests queued): admission() about 0.55 ms (two replays per bucket);
schedule() one replay when the deadlines are loose, and one per batch size tried when they are tight: 1.8 ms at
max_batch_size 8 and 6 ms at 32 when every size has to be tried.

Predictions are only as good as the latency model; `margin_s` keeps that much slack between a predicted finish
and a deadline for admission and the cap (never for giving up). Without a measured model, make_policy uses
LatencyModel.zero(): the ordering rules hold, nothing is refused or given up early, and the cost-aware cap learns
its curve from the steps alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..costs.latency_model import Bucket, LatencyModel
from ..costs.online import OnlineStepCurve
from ..types import Request, RequestStatus, StepPlan
from .adaptive import cost_aware_cap
from .predict import earliest_finish, interleave, predict_finish_times

ORDERS = ("edf", "srs")
DEFAULT_STARVATION_S = 30.0
# Float rounding between a prediction and the engine's own sums: a prediction must beat a deadline by this much
# to count as meeting it, and miss it by this much before a request is given up.
EPS_S = 1e-9


class SLOPolicy:
    """The rules in the module docstring. schedule() keeps the round-robin deficits; admission(), retry_after_s()
    and predict() only read, so a front end may call them outside the engine loop on a snapshot of its queues."""

    name = "slo"

    def __init__(
        self,
        max_batch_size: int,
        latency_model: LatencyModel,
        order: str = "edf",
        starvation_s: float = DEFAULT_STARVATION_S,
        margin_s: float = 0.0,
        cost_aware: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not isinstance(latency_model, LatencyModel):
            raise ValueError(f"latency_model must be a LatencyModel, got {type(latency_model).__name__}")
        if order not in ORDERS:
            raise ValueError(f"order: {order!r} is not supported; allowed: {', '.join(ORDERS)}")
        if not starvation_s > 0:
            raise ValueError(f"starvation_s must be > 0 seconds (math.inf: no guard), got {starvation_s}")
        if not margin_s >= 0 or not math.isfinite(margin_s):
            raise ValueError(f"margin_s must be a finite number of seconds >= 0, got {margin_s}")
        self.max_batch_size = max_batch_size
        self.latency_model = latency_model
        self.order = order
        self.starvation_s = starvation_s
        self.margin_s = margin_s
        self._deficit: dict[Bucket, float] = {}  # deficit round-robin state, seconds of step cost
        # the cost-aware bound on the cap (scheduling/adaptive.py): where batching does not pay, fewer at a time
        self.curve = OnlineStepCurve(None if latency_model.metadata.get("source") == "zero" else latency_model,
                                     max_batch_size)
        self.cost_aware = cost_aware
        self.cap: dict[Bucket, int] = {}  # the cost-aware cap in force per bucket (for logs and /metrics)
        self._steps = 0

    # --- the step ----------------------------------------------------------------------------------------------
    def schedule(
        self, waiting: Sequence[Request], running: Sequence[Request], now: float, draining: bool = False
    ) -> StepPlan:
        """Give up on hopeless requests, pick a bucket, fill its free slots, run the first `cap` slot holders."""
        give_up = [r for r in list(running) + list(waiting) if self.cannot_make_it(r, now)]
        if give_up:
            gone = {id(r) for r in give_up}
            running = [r for r in running if id(r) not in gone]
            waiting = [r for r in waiting if id(r) not in gone]
        groups = _by_bucket(running, waiting)
        if not groups:
            self._deficit.clear()
            return StepPlan(give_up=give_up)
        free = max(self.max_batch_size - len(running), 0)  # slots are shared by all buckets
        room = {b: min(free, max(q - len(groups[b][0]), 0)) for b, q in self._quotas(groups).items()}
        bucket = self._pick_bucket([b for b, (run_b, _) in groups.items() if run_b or room[b]])
        key = self._key(now)
        pool, rest = self._service_order(*groups[bucket], key, room[bucket])
        others = [self._backlog_s(b, *groups[b], key, now) for b in groups if b != bucket]
        cap = self._choose_cap(pool, rest, bucket, others, now)
        if self.cost_aware:
            self._steps += 1
            self.cap[bucket] = max(cost_aware_cap(self.curve, bucket, len(pool), self._steps), 1)
            cap = min(cap, self.cap[bucket])
        batch = pool[:cap]
        self._charge(bucket, self.latency_model.step_s(len(batch), bucket))
        admit = [r for r in batch if r.status is RequestStatus.WAITING]
        return StepPlan(admit=admit, run=batch, give_up=give_up)

    def observe(self, bucket: Bucket, batch_size: int, seconds: float) -> None:
        """A denoising step of `batch_size` requests of `bucket` took `seconds` (the executor's own measure)."""
        self.curve.observe(bucket, batch_size, seconds)

    # --- front end ---------------------------------------------------------------------------------------------
    def admission(
        self, request: Request, waiting: Sequence[Request], running: Sequence[Request], now: float
    ) -> str | None:
        """Why `request` should be refused now (None: admit). Requests without a deadline are always admitted."""
        if request.deadline is None:
            return None
        never = self.infeasible(request, now)
        if never is not None:
            return never
        waiting = [r for r in waiting if r is not request]
        running = [r for r in running if r is not request]
        left = request.deadline - now
        # steady state: the bucket's batch does not shrink below its present size (freed slots are refilled)
        floor = len([r for r in list(running) + waiting if r.bucket == request.bucket]) + 1
        before = self.predict(waiting, running, now, floor_batch=floor)
        after = self.predict(waiting + [request], running, now, floor_batch=floor)
        mine = after[id(request)]
        if not self._meets(mine, request):
            return (f"deadline cannot be met under the current load: predicted to finish in {mine - now:.3f} s, "
                    f"deadline in {left:.3f} s")
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
        alone = earliest_finish(request, self.latency_model, now)
        if alone <= request.deadline + EPS_S:
            return None
        return (f"deadline cannot be met: it needs at least {alone - now:.3f} s even alone, and its deadline is "
                f"in {request.deadline - now:.3f} s")

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

    def cannot_make_it(self, r: Request, now: float) -> bool:
        """Even alone, at batch size 1, from now, `r` would finish after its deadline."""
        return r.deadline is not None and earliest_finish(r, self.latency_model, now) > r.deadline + EPS_S

    # --- rules -------------------------------------------------------------------------------------------------
    def _key(self, now: float) -> Callable[[Request], tuple]:
        """The service order (module docstring) as a sort key."""
        srs = self.order == "srs"

        def key(r: Request) -> tuple:
            if now - r.arrival_time > self.starvation_s:
                return (0, r.arrival_time)
            if r.deadline is None:  # no deadline: after those with one, in arrival order (either order)
                return (1, -r.priority, math.inf, math.inf, r.arrival_time)
            first = r.num_inference_steps - r.step if srs else r.deadline
            return (1, -r.priority, first, r.deadline, r.arrival_time)

        return key

    def _service_order(self, running: list[Request], waiting: list[Request], key: Callable[[Request], tuple],
                       free: int | None = None) -> tuple[list[Request], list[Request]]:
        """(slot holders after this step's admissions, in service order; the requests that stay queued). `free`:
        the slots free for these waiting requests (default: the bucket's own, as the per-bucket replays count)."""
        queue = sorted(waiting, key=key)
        if free is None:
            free = max(self.max_batch_size - len(running), 0)
        return sorted(running + queue[:free], key=key), queue[free:]

    def _meets(self, finish: float, r: Request) -> bool:
        return r.deadline is None or finish + self.margin_s + EPS_S <= r.deadline

    def _choose_cap(self, pool: list[Request], rest: list[Request], bucket: Bucket, others: list[float],
                    now: float) -> int:
        """The largest batch size that keeps the deadline of every request of the bucket (rule: adaptive cap)."""
        order = pool + rest
        checked = [i for i, r in enumerate(order) if r.deadline is not None]
        if not checked:
            return self.max_batch_size
        best_met, best_cap = -1, self.max_batch_size
        for cap in range(self.max_batch_size, 0, -1):
            fins = predict_finish_times(order, cap, self.latency_model, now, bucket)
            met = sum(self._meets(now + interleave(fins[i] - now, others), order[i]) for i in checked)
            if met == len(checked):
                return cap
            if met > best_met:
                best_met, best_cap = met, cap
        return best_cap

    def _backlog_s(self, bucket: Bucket, running: list[Request], waiting: list[Request],
                   key: Callable[[Request], tuple], now: float) -> float:
        """Seconds of engine time the work of `bucket` needs, alone at the full batch cap."""
        pool, rest = self._service_order(running, waiting, key)
        fins = predict_finish_times(pool + rest, self.max_batch_size, self.latency_model, now, bucket)
        return max(fins) - now

    def _quotas(self, groups: dict[Bucket, Group]) -> dict[Bucket, int]:
        """Slots per bucket: max_batch_size shared max-min fairly by the buckets' demands (running + waiting; the
        older work first on ties), so that buckets can take turns in engine time (rule: slots)."""
        quotas, left = {}, self.max_batch_size
        ranked = sorted(groups, key=lambda b: len(groups[b][0]) + len(groups[b][1]))  # stable: oldest first
        for i, b in enumerate(ranked):
            quotas[b] = min(len(groups[b][0]) + len(groups[b][1]), -(-left // (len(ranked) - i)))
            left -= quotas[b]
        return quotas

    def _pick_bucket(self, buckets: list[Bucket]) -> Bucket:
        """Deficit round-robin (rule: buckets); `buckets` lists the buckets with work, oldest work first."""
        active = set(buckets)
        for b in [b for b in self._deficit if b not in active]:
            del self._deficit[b]
        lead = max(self._deficit.values(), default=0.0)
        for b in buckets:
            self._deficit.setdefault(b, lead)
        return max(buckets, key=lambda b: self._deficit[b])  # the first of equals: the oldest work

    def _charge(self, bucket: Bucket, cost_s: float) -> None:
        self._deficit[bucket] -= cost_s
        lead = max(self._deficit.values())
        for b in self._deficit:  # keep the leader at 0 so the numbers stay small; differences are what count
            self._deficit[b] -= lead


Group = tuple[list[Request], list[Request]]  # (running, waiting) of one bucket


def _by_bucket(running: Sequence[Request], waiting: Sequence[Request]) -> dict[Bucket, Group]:
    """Requests grouped by bucket as (running, waiting), buckets ordered by their oldest request's arrival."""
    groups: dict[Bucket, Group] = {}
    oldest: dict[Bucket, float] = {}
    for i, r in enumerate(list(running) + list(waiting)):
        groups.setdefault(r.bucket, ([], []))[0 if i < len(running) else 1].append(r)
        oldest[r.bucket] = min(oldest.get(r.bucket, math.inf), r.arrival_time)
    return {b: groups[b] for b in sorted(groups, key=oldest.__getitem__)}
