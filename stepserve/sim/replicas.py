"""Several replicas behind a router, on one simulated clock.

Each replica is a real EngineCore (its own policy and queue) around its own executor, normally the fake executor
charging a measured latency model, so its steps take the time the model says. A router (stepserve.fleet.routers)
places each arrival at its arrival time from the replicas' stats at that moment (sim.fleet.Fleet: what each
engine holds, priced by the latency model; adapters; staleness; or a central queue instead of a router). The
clock is the simulated clock's one loop (stepserve.sim.loop), the one `simulate` runs a single engine on, so one
replica behind any router gives the same finish times as simulate on the same trace.

Every arrival ends with one outcome: completed, rejected (refused at admission), failed (a deadline, an executor
error, an invalid request, its replica lost) or unfinished (still out when the run stopped: at `stop_at`, or
early once enough requests missed the SLO that its p95 cannot hold).

Cost: bounded by the engines themselves (100k requests over a few replicas: tens of seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..bench.metrics import percentile
from ..engine.core import EngineCore
from ..request.types import Request, RequestStatus, StepReport
from ..fleet.routers import Router
from .device import Models, latency_of
from .fleet import Fleet
from .loop import Arrival, SimLoop

COMPLETED, REJECTED, FAILED, UNFINISHED = "completed", "rejected", "failed", "unfinished"
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
    lost: list[int] = field(default_factory=list)  # replicas that failed during the run
    adapter_loads: int = 0  # adapter loads paid, all replicas together
    replica_s: float = 0.0  # replica-seconds paid: replicas times the time they ran (starting included)
    replicas: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas paid for) at every change


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


def run_replicas(
    cores: Sequence[EngineCore | Models],
    arrivals: Sequence[Arrival],
    router: Router | Fleet | None,
    stop_at: float | None = None,
    slo_s: float | None = None,
    miss_limit: int | None = None,
    warmup_s: float = 0.0,
    on_progress: Callable[[int], None] | None = None,
    failures: Sequence[tuple[int, float]] = (),
    on_step: Callable[[int, float, StepReport], None] | None = None,
) -> FleetResult:
    """Serve `arrivals` on `cores` (one per replica, each fresh; a sim.device.Models for a replica of several
    models, each arrival going to the model it names) behind `router` (a Router, read from fresh
    stats priced by the cores' own latency model; or a Fleet built by the caller).

    stop_at: simulated time at which the run stops (what is still out is unfinished); None runs until every
    request has ended. miss_limit (with slo_s): stop as soon as more than this many measured requests (arrived at
    or after warmup_s) are known to miss the SLO (rejected, failed, or completed later than slo_s): with
    miss_limit = allowed_misses(measured count) the p95 can no longer hold, so the rest need not be simulated.
    failures: (replica, time) pairs: that replica is lost then, and what it holds fails. on_progress(k) is called
    with the number of requests that ended since the last call."""
    if not cores:
        raise ValueError("run_replicas needs at least one replica")
    if miss_limit is not None and slo_s is None:
        raise ValueError("miss_limit needs slo_s: a miss is a request later than the SLO")
    # replicas of several models price each model by its own engine's latency model (sim.device.Models.stats)
    one = cores[0] if isinstance(cores[0], EngineCore) else None
    fleet = router if isinstance(router, Fleet) else Fleet(router, None if one is None else latency_of(one))
    fleet.until = max((a.time for a in arrivals), default=0.0)
    loop = SimLoop(cores, fleet, stop_at)
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].time)
    for i in order:
        loop.arrive(arrivals[i].time, arrivals[i].params, i, arrivals[i].adapter, arrivals[i].model)
        if arrivals[i].abort_at is not None:
            loop.abort(arrivals[i].abort_at, i)
    for r, t in failures:
        fleet.once(t, lambda t, r=r: fleet.fail(r, t))
    outcomes = [Outcome(a.time) for a in arrivals]
    result = FleetResult(outcomes)
    misses = ended = 0

    def routed(i: int, replica: int) -> None:
        outcomes[i].replica = replica

    def end(i: int, t: float, request: Request | None, error: Exception | None) -> None:
        nonlocal misses, ended
        o = outcomes[i]
        o.finish = t
        o.status = FAILED if request is None else _STATUS.get(request.status, FAILED)
        ended += 1
        if slo_s is not None and o.arrival >= warmup_s and (o.status != COMPLETED or t - o.arrival > slo_s):
            misses += 1

    def stepped(r: int, t: float, report: StepReport) -> None:
        result.steps += 1
        while len(result.busy_s) <= r:
            result.busy_s.append(0.0)
        result.busy_s[r] += report.duration_s
        if on_step is not None:
            on_step(r, t, report)

    def after_event() -> bool:
        nonlocal ended
        if on_progress is not None and ended:
            on_progress(ended)
            ended = 0
        return miss_limit is not None and misses > miss_limit

    loop.run(end, stepped, routed, after_event)
    result.busy_s += [0.0] * (len(loop.reps) - len(result.busy_s))
    result.end_time, result.stopped_early = loop.end_time, loop.stopped_early
    result.lost, result.adapter_loads = sorted(loop.lost), fleet.adapter_loads
    if fleet.autoscaler is not None:
        result.replica_s = fleet.autoscaler.total_replica_s(loop.end_time)
        result.replicas = list(fleet.autoscaler.counts)
    else:
        result.replica_s = len(cores) * loop.end_time
        result.replicas = [(0.0, len(cores))]
    return result


_STATUS = {RequestStatus.COMPLETED: COMPLETED, RequestStatus.REJECTED: REJECTED}


def latency_cores(n: int, latency, options, noise: float = 0.0, seed: int = 0) -> list[EngineCore]:
    """n fresh engines with these EngineOptions, each on its own fake executor charging `latency` (replica
    r's noise seeded by seed * 1000 + r, so replicas do not draw in lockstep)."""
    from ..costs import FakeExecutor

    return [options.make_core(FakeExecutor.charging(latency, noise, seed * 1000 + r)) for r in range(n)]
