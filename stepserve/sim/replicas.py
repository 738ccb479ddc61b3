"""Several replicas behind a router, on one simulated clock.

Each replica is a real EngineCore (its own policy and queue) around its own executor, normally a
LatencyModelExecutor, so its steps take the time a measured latency model says. A router (stepserve.sim.routers)
places each arrival at its arrival time, from the replicas' outstanding counts at that moment.

The event loop always handles whatever comes first: the next arrival, or the next replica event (the end of its
current step, or the wake-up its policy asked for when idle). A request routed to a replica in the middle of a
step waits in that replica's inbox and joins at the end of the step, exactly as stepserve.sim.run.simulate feeds
a single engine; a request routed to an idle replica wakes it at once. So one replica behind any router gives
the same finish times as simulate on the same trace.

Every arrival ends with one outcome: completed, rejected (refused at admission), failed (a deadline, an executor
error, an invalid request) or unfinished (still out when the run stopped: at `stop_at`, or early once enough
requests missed the SLO that its p95 cannot hold).

Cost: a heap of replica events, a few dictionary operations per request and one engine step per event, so it is
bounded by the engines themselves (100k requests over a few replicas: tens of seconds).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..bench.metrics import percentile
from ..engine import AdmissionError, EngineCore
from ..types import RequestStatus
from ..validation import ValidationError
from .routers import Router
from .run import Arrival

COMPLETED, REJECTED, FAILED, UNFINISHED = "completed", "rejected", "failed", "unfinished"
MAX_EVENTS = 100_000_000  # a guard against a policy that never settles
INF = math.inf


@dataclass
class Outcome:
    """What became of one arrival. `finish`: when its final state was reached (None while unfinished)."""

    arrival: float
    replica: int = -1  # -1: never routed (the run stopped before it arrived)
    status: str = UNFINISHED
    finish: float | None = None

    @property
    def latency(self) -> float:
        """Seconds from arrival to the image; infinite for anything that did not complete."""
        if self.status != COMPLETED or self.finish is None:
            return INF
        return self.finish - self.arrival


@dataclass
class FleetResult:
    outcomes: list[Outcome]  # one per arrival, in the order the arrivals were given
    end_time: float = 0.0  # simulated time the run stopped
    steps: int = 0  # engine steps taken, all replicas together
    busy_s: list[float] = field(default_factory=list)  # per replica: time spent in executor steps
    stopped_early: bool = False  # stopped once the SLO could no longer hold (see run_replicas' miss_limit)


@dataclass
class Summary:
    """p50/p95/p99 count every request that did not complete as infinitely late (a refusal is not fast)."""

    offered: int
    completed: int
    rejected: int
    failed: int
    unfinished: int
    p50_s: float
    p95_s: float
    p99_s: float
    within_slo: int | None = None  # completed within the SLO (goodput), when an SLO was given
    goodput_frac: float | None = None  # within_slo / offered


def summarize(result: FleetResult, slo_s: float | None = None, warmup_s: float = 0.0) -> Summary:
    """The numbers of a run; requests that arrived before `warmup_s` are left out."""
    measured = [o for o in result.outcomes if o.arrival >= warmup_s]
    counts = {COMPLETED: 0, REJECTED: 0, FAILED: 0, UNFINISHED: 0}
    for o in measured:
        counts[o.status] += 1
    latencies = [o.latency for o in measured]
    p = (lambda q: percentile(latencies, q)) if latencies else (lambda q: INF)
    summary = Summary(len(measured), counts[COMPLETED], counts[REJECTED], counts[FAILED], counts[UNFINISHED],
                      p(50), p(95), p(99))
    if slo_s is not None:
        summary.within_slo = sum(1 for v in latencies if v <= slo_s)
        summary.goodput_frac = summary.within_slo / len(measured) if measured else None
    return summary


def allowed_misses(n: int, q: float = 95.0) -> int:
    """How many of n samples may exceed a bound while the nearest-rank q-th percentile still holds it."""
    return n - max(1, math.ceil(q / 100.0 * n)) if n else 0


class _Replica:
    __slots__ = ("core", "inbox", "next_t", "busy", "stamp", "busy_s")

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.inbox: list[int] = []  # arrival indices routed here, not yet handed to the engine
        self.next_t = INF  # when this replica acts next
        self.busy = False  # next_t is the end of a step (True) or a wake-up / nothing (False)
        self.stamp = 0  # bumped whenever next_t changes; stale heap entries are skipped
        self.busy_s = 0.0


def run_replicas(
    cores: Sequence[EngineCore],
    arrivals: Sequence[Arrival],
    router: Router,
    stop_at: float | None = None,
    slo_s: float | None = None,
    miss_limit: int | None = None,
    warmup_s: float = 0.0,
    on_progress: Callable[[int], None] | None = None,
) -> FleetResult:
    """Serve `arrivals` on `cores` (one per replica, each fresh) behind `router`.

    stop_at: simulated time at which the run stops (what is still out is unfinished); None runs until every
    request has ended. miss_limit (with slo_s): stop as soon as more than this many measured requests (arrived at
    or after warmup_s) are known to miss the SLO (rejected, failed, or completed later than slo_s): with
    miss_limit = allowed_misses(measured count) the p95 can no longer hold, so the rest need not be simulated.
    on_progress(k) is called with the number of requests that ended since the last call."""
    if not cores:
        raise ValueError("run_replicas needs at least one replica")
    if miss_limit is not None and slo_s is None:
        raise ValueError("miss_limit needs slo_s: a miss is a request later than the SLO")
    if any(a.abort_at is not None for a in arrivals):
        raise ValueError("arrivals with abort_at are not supported behind a router")
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].time)
    outcomes = [Outcome(a.time) for a in arrivals]
    reps = [_Replica(c) for c in cores]
    outstanding = [0] * len(reps)
    live: dict[str, int] = {}  # request id -> arrival index
    heap: list[tuple[float, int, int]] = []  # (time, replica, stamp)
    result = FleetResult(outcomes)
    horizon = INF if stop_at is None else stop_at
    misses = 0
    ended = 0

    def end(i: int, status: str, t: float) -> None:
        nonlocal misses, ended
        o = outcomes[i]
        if t > horizon:  # would have come after the stop: still out then
            return
        o.status, o.finish = status, t
        outstanding[o.replica] -= 1
        ended += 1
        if slo_s is not None and o.arrival >= warmup_s and (status != COMPLETED or t - o.arrival > slo_s):
            misses += 1

    def schedule(r: int, t: float, busy: bool) -> None:
        rep = reps[r]
        rep.next_t, rep.busy = t, busy
        rep.stamp += 1
        if t < INF:
            heapq.heappush(heap, (t, r, rep.stamp))

    def act(r: int, t: float) -> None:
        rep = reps[r]
        core = rep.core
        for i in rep.inbox:
            try:
                live[core.add_request(arrivals[i].params, t).request_id] = i
            except AdmissionError:
                end(i, REJECTED, t)  # told at once; the engine's own report of it is skipped below
            except ValidationError:
                end(i, FAILED, t)
        rep.inbox.clear()
        if t >= horizon or not core.has_work():
            schedule(r, INF, False)
            return
        report = core.step(t)
        result.steps += 1
        for req in report.finished:
            i = live.pop(req.request_id, None)
            if i is not None:
                status = COMPLETED if req.status is RequestStatus.COMPLETED else (
                    REJECTED if req.status is RequestStatus.REJECTED else FAILED)
                end(i, status, req.timing.finished)
        if report.duration_s > 0:
            rep.busy_s += report.duration_s
            schedule(r, t + report.duration_s, True)
        elif report.finished:
            schedule(r, t, True)  # something ended at no cost: look again at once
        else:  # idle: until the policy's wake-up, or an arrival (see the routing below)
            schedule(r, INF if report.wake_at is None else max(report.wake_at, t), False)

    nxt = 0
    t = 0.0
    for _ in range(MAX_EVENTS):
        while heap and heap[0][2] != reps[heap[0][1]].stamp:
            heapq.heappop(heap)
        ta = arrivals[order[nxt]].time if nxt < len(order) else INF
        tr = heap[0][0] if heap else INF
        t_next = min(ta, tr)
        if t_next == INF or t_next > horizon:
            break
        t = t_next
        if ta <= tr:  # an arrival first (as simulate adds arrivals before stepping)
            i = order[nxt]
            nxt += 1
            r = router.pick(outstanding)
            if not 0 <= r < len(reps):
                raise ValueError(f"router {getattr(router, 'name', router)!r} picked replica {r} of {len(reps)}")
            outcomes[i].replica = r
            outstanding[r] += 1
            rep = reps[r]
            rep.inbox.append(i)
            if not rep.busy and ta < rep.next_t:
                schedule(r, ta, False)
        else:
            _, r, _ = heapq.heappop(heap)
            act(r, tr)
        if on_progress is not None and ended:
            on_progress(ended)
            ended = 0
        if miss_limit is not None and misses > miss_limit:
            result.stopped_early = True
            break
    else:
        raise RuntimeError(f"simulation did not finish within {MAX_EVENTS} events")
    if stop_at is None and not result.stopped_early:
        stuck = [r for r, rep in enumerate(reps) if rep.core.has_work() or rep.inbox]
        if stuck:
            raise RuntimeError(f"replica {stuck[0]} is stuck: work is queued but nothing can make progress")
    result.end_time = t
    result.busy_s = [rep.busy_s for rep in reps]
    return result


def latency_cores(n: int, latency, options, noise: float = 0.0, seed: int = 0) -> list[EngineCore]:
    """n fresh engines with these EngineOptions, each on its own LatencyModelExecutor charging `latency` (replica
    r's noise seeded by seed * 1000 + r, so replicas do not draw in lockstep)."""
    from ..costs import FakeExecutor

    return [options.make_core(FakeExecutor.charging(latency, noise, seed * 1000 + r)) for r in range(n)]
