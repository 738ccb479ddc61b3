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
  probe of one more or one fewer now and then; where that is 1, as many as lower the total latency of the slot
  holders: a short request shares the steps of a longer one ahead), the curve a prior (the latency model)
  corrected online by the steps the executor reports (`observe`). While requests of the bucket wait for a slot,
  any gain over 1% pays (throughput then sets their wait), unless a deadline or priority among them could be
  hurt: unless every deadline would be met even with the bucket's work run one request at a time. Otherwise the
  deadline cap decides, since batches formed for throughput slow requests toward their deadlines (live, the tiny
  Flux at 0.7 load with 3x deadlines met 85% of them so, against 91% one at a time). `cost_aware=False` turns it
  off.
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

Cost. While no request in the engine has a deadline or a priority, the service order is arrival order and a step
reads only the running requests and the head of each bucket's queue (`_plain_step`; the same plans): about 20 us a
step with 10 and with 10,000 queued (benchmarks/host_cost.py --no-deadlines). Otherwise the step reads the queue
through indexes kept as requests are queued (scheduling/slo_index.py: per bucket the service order, per bucket and
remaining steps the deadlines, per bucket the sums), so its host work does not grow with the queue either: the
adaptive cap replays the slot holders and one batch (`horizon`) of the queue behind them, and a bucket with more
than that is taken at its fluid backlog (fleet/work.py). Within the horizon the plans are those of a full scan.
admission() still replays the bucket's queue (same measurement as predict.py, 200 requests queued: about
0.55 ms; once per arrival, not per step).

Predictions are only as good as the latency model, which is read corrected by the step times the engine observes
(costs/drift.py: the profile times observed over predicted, per bucket), so a machine that became slower or
faster since the profile moves admission and give-up with it; `margin_s` keeps that much slack between a
predicted finish and a deadline for admission and the cap (never for giving up). Without a measured model,
make_policy uses LatencyModel.zero(): the ordering rules hold, nothing is refused or given up early, and the
cost-aware cap learns its curve from the steps alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..costs.drift import DriftCorrected
from ..costs.latency_model import Bucket, LatencyModel
from ..costs.online import OnlineStepCurve
from ..request.types import Request, RequestStatus, StepPlan
from .adaptive import cost_aware_cap
from .predict import earliest_finish, interleave, predict_finish_times
from .queue import WaitingQueue, as_queue, is_urgent
from .slo_front import EPS_S, SLOFrontEnd
from .slo_index import Indexed

ORDERS = ("edf", "srs")
HORIZON_BATCHES = 1  # the deadline cap judges the slot holders and this many batches of the queue behind them
DEFAULT_STARVATION_S = 30.0


class SLOPolicy(SLOFrontEnd):
    """The rules in the module docstring. schedule() keeps the round-robin deficits; admission(), retry_after_s()
    and predict() only read, so a front end may call them outside the engine loop on a snapshot of its queues."""

    name = "slo"
    plain_path = True  # take _plain_step when no request has a deadline or priority (False: always the general path)

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
        # what every prediction reads: the profile, corrected by the step times observed (costs/drift.py)
        self.latency_model = DriftCorrected(latency_model)
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
        # requests past the slots to fill that the adaptive cap's replay predicts (None: the whole queue)
        self.horizon: int | None = HORIZON_BATCHES * max_batch_size

    # --- the step ----------------------------------------------------------------------------------------------
    def schedule(
        self, waiting: Sequence[Request], running: Sequence[Request], now: float, draining: bool = False
    ) -> StepPlan:
        """Give up on hopeless requests, pick a bucket, fill its free slots, run the first `cap` slot holders."""
        queue = as_queue(waiting)
        if self.plain_path and not queue.urgent and not any(is_urgent(r) for r in running):
            return self._plain_step(queue, running)
        seen = Indexed(self, queue, now)
        give_up = [r for r in running if self.cannot_make_it(r, now)] + seen.hopeless()
        if give_up:
            gone = set(give_up)
            running = [r for r in running if r not in gone]
        held: dict[Bucket, list[Request]] = {}
        for r in running:
            held.setdefault(r.bucket, []).append(r)
        oldest = {b: min(r.arrival_time for r in rs) for b, rs in held.items()}
        for b in queue.buckets():
            if seen.count(b) > 0:
                oldest[b] = min(oldest.get(b, math.inf), seen.oldest(b))
        if not oldest:
            self._deficit.clear()
            return StepPlan(give_up=give_up)
        groups = sorted(oldest, key=oldest.__getitem__)  # by their oldest request, as _by_bucket orders them
        free = max(self.max_batch_size - len(running), 0)  # slots are shared by all buckets
        demand = {b: len(held.get(b, ())) + seen.count(b) for b in groups}
        room = {b: min(free, max(q - len(held.get(b, ())), 0)) for b, q in self._quotas(demand).items()}
        bucket = self._pick_bucket([b for b in groups if held.get(b) or room[b]])
        key = self._key(now)
        mine = held.get(bucket, [])
        horizon = self.horizon
        head = seen.order(bucket, None if horizon is None else room[bucket] + horizon)
        joining, rest = head[:room[bucket]], head[room[bucket]:]
        pool = sorted(mine + joining, key=key)
        left = seen.count(bucket) - len(joining)  # requests of the bucket that stay queued
        others = [seen.backlog_s(b, held.get(b, []), horizon, key) for b in groups if b != bucket]
        queued = left if seen.loose(pool, joining, left, bucket) else 0  # the backlog rule (rule: cost-aware)
        return self._run(bucket, pool, self._choose_cap(pool, rest, bucket, others, now), give_up, queued)

    def _plain_step(self, queue: WaitingQueue, running: Sequence[Request]) -> StepPlan:
        """schedule() when no request has a deadline or a priority: the service order is then arrival order,
        nothing is given up and the deadline cap is max_batch_size, so the step reads the running requests and
        the head of each bucket's queue only, whatever the queue's length (the same plan as the general path)."""
        held: dict[Bucket, list[Request]] = {}
        for r in running:
            held.setdefault(r.bucket, []).append(r)
        demand = {b: len(rs) for b, rs in held.items()}
        for b in queue.buckets():
            demand[b] = demand.get(b, 0) + queue.count(b)
        if not demand:
            self._deficit.clear()
            return StepPlan()
        if len(demand) > 1:  # by their oldest request (one bucket: nothing to order)
            oldest = {b: min([r.arrival_time for r in held.get(b, ())] + [r.arrival_time for r in queue.head(b, 1)])
                      for b in demand}
            demand = {b: demand[b] for b in sorted(demand, key=oldest.__getitem__)}
        free = max(self.max_batch_size - len(running), 0)
        room = {b: min(free, max(q - len(held.get(b, ())), 0)) for b, q in self._quotas(demand).items()}
        bucket = self._pick_bucket([b for b in demand if held.get(b) or room[b]])
        pool = sorted(held.get(bucket, []) + queue.head(bucket, room[bucket]), key=lambda r: r.arrival_time)
        return self._run(bucket, pool, self.max_batch_size, [], queue.count(bucket) - room[bucket])

    def _run(self, bucket: Bucket, pool: list[Request], cap: int, give_up: list[Request],
             queued: int = 0) -> StepPlan:
        """The step's plan: the first `cap` of `pool` (slot holders in service order), bounded by the cost-aware
        cap (`queued`: the bucket's requests left waiting for a slot, 0 when a deadline or priority among them
        could be hurt: slo_index.Indexed.loose); the rest pause."""
        if self.cost_aware:
            self._steps += 1
            remaining = [r.num_inference_steps - r.step for r in pool]
            self.cap[bucket] = max(cost_aware_cap(self.curve, bucket, remaining, self._steps, queued=queued), 1)
            cap = min(cap, self.cap[bucket])
        batch = pool[:cap]
        if len(self._deficit) > 1:
            self._charge(bucket, self.latency_model.step_s(len(batch), bucket))
        else:  # the one bucket with work leads at 0, whatever the step costs (what _charge leaves)
            self._deficit[bucket] = 0.0
        admit = [r for r in batch if r.status is RequestStatus.WAITING]
        return StepPlan(admit=admit, run=batch, give_up=give_up)

    def observe(self, bucket: Bucket, batch_size: int, seconds: float) -> None:
        """A denoising step of `batch_size` requests of `bucket` took `seconds` (the executor's own measure)."""
        self.curve.observe(bucket, batch_size, seconds)
        self.latency_model.observe(bucket, batch_size, seconds)

    def plan_share(self, share: float) -> None:
        """Plan at `share` of the device (a device shared with other models that have work: device_share.py):
        every prediction, admission and give-up included, is stretched by 1/share until the next call."""
        self.latency_model.share = min(1.0, max(share, 1e-3))

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

    def _quotas(self, demand: dict[Bucket, int]) -> dict[Bucket, int]:
        """Slots per bucket: max_batch_size shared max-min fairly by the buckets' demands (running + waiting, in
        the order of their oldest request: the older work first on ties), so that buckets can take turns in
        engine time (rule: slots)."""
        quotas, left = {}, self.max_batch_size
        ranked = sorted(demand, key=demand.__getitem__)  # stable: oldest first
        for i, b in enumerate(ranked):
            quotas[b] = min(demand[b], -(-left // (len(ranked) - i)))
            left -= quotas[b]
        return quotas

    def _pick_bucket(self, buckets: list[Bucket]) -> Bucket:
        """Deficit round-robin (rule: buckets); `buckets` lists the buckets with work, oldest work first."""
        if len(buckets) == 1 and len(self._deficit) == 1 and buckets[0] in self._deficit:
            return buckets[0]  # the one bucket with work, already the only one with a deficit: nothing changes
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
