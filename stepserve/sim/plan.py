"""Capacity planning: the fewest replicas that hold a p95 latency SLO at a given request rate.

For each strategy, a seeded Poisson trace at the rate is served by n simulated replicas (stepserve.sim.replicas)
behind a router, and the p95 latency from arrival is compared with the SLO. A request that was refused, failed
or was still out when the run stopped counts as infinitely late: a fleet that holds its p95 by turning work
away does not hold it.

The search assumes more replicas never hurt: it tries 1, 2, 4, ... until a count holds (or max_replicas
fails), then bisects between the last count that failed and the first that held. Every count is simulated on the
same trace. A run that can no longer hold (more requests have missed than the p95 allows) stops early; the
answer and the count one below it are always simulated to the end, so their p95 are exact.

The assumption can fail: static batching waits to fill a batch (up to its flush timeout), so spreading a load
thinner can make it slower, and such a strategy may be reported as missing at max_replicas while some smaller
count holds. Every count tried is listed, in the output and in plan.json.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..bench.targets import Contender
from ..bench.workload import Mix, poisson_trace
from ..costs import LatencyModel
from ..scheduling import DEFAULT_STRATEGY
from ..util.words import noun_for
from .replicas import FleetResult, allowed_misses, run_replicas, summarize
from ..fleet.routers import PLANNING_ROUTER, make_router
from .run import Arrival

DEFAULT_STRATEGIES = (DEFAULT_STRATEGY, "continuous", "dynamic")  # the default first, then the fixed contenders


@dataclass
class PlanSpec:
    latency: LatencyModel
    rate_rps: float
    slo_s: float  # the p95 bound
    mix: Mix
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    router: str = PLANNING_ROUTER
    max_replicas: int = 64
    duration_s: float = 120.0  # measured arrivals, after the warm-up
    warmup_s: float = 0.0  # arrivals before this are served but not counted
    drain_s: float | None = None  # after the last arrival; None: max(5 s, 3 x the SLO), as the bench
    seed: int = 0
    max_batch_size: int = 8
    timeout_s: float | None = None  # every request's deadline (the slo strategy needs one to act)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_rps) and self.rate_rps > 0):
            raise ValueError(f"rate must be a number > 0 requests/s, got {self.rate_rps}")
        if not (math.isfinite(self.slo_s) and self.slo_s > 0):
            raise ValueError(f"the SLO must be > 0 s, got {self.slo_s}")
        if self.max_replicas < 1:
            raise ValueError(f"max_replicas must be >= 1, got {self.max_replicas}")
        if not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration_s}")

    @property
    def stop_at(self) -> float:
        drain = max(5.0, 3.0 * self.slo_s) if self.drain_s is None else self.drain_s
        return self.warmup_s + self.duration_s + drain


@dataclass
class Probe:
    """One simulated replica count. Latencies in seconds; math.inf where more than that share did not complete
    in time to be counted (refused, failed, unfinished)."""

    replicas: int
    p50_s: float
    p95_s: float
    p99_s: float
    offered: int
    completed: int
    rejected: int
    failed: int
    unfinished: int
    goodput_frac: float | None  # share of measured requests completed within the SLO
    held: bool
    stopped_early: bool  # stopped once the SLO could not hold; p95 is then only known to exceed it
    steps: int
    wall_s: float  # real seconds the simulation took


@dataclass
class StrategyPlan:
    strategy: str
    replicas: int | None  # the answer; None: even max_replicas misses the SLO
    probes: list[Probe] = field(default_factory=list)  # by replica count

    def at(self, n: int) -> Probe | None:
        return next((p for p in self.probes if p.replicas == n), None)


def trace_arrivals(spec: PlanSpec) -> list[Arrival]:
    """The plan's trace: Poisson at the rate over warm-up + duration, requests drawn from the mix; seeded."""
    trace = poisson_trace(spec.mix, spec.rate_rps, spec.warmup_s + spec.duration_s, spec.seed)
    trace = trace.with_timeout(spec.timeout_s)
    return [Arrival(item.offset_s, item.spec.to_params()) for item in trace.items]


def simulate_fleet(spec: PlanSpec, strategy: str, replicas: int, stop_early: bool = True,
                   on_progress: Callable[[int], None] | None = None) -> tuple[FleetResult, Probe]:
    """Serve the plan's trace on `replicas` engines of `strategy` behind the plan's router."""
    from .bench import SimSetup, make_core

    setup = SimSetup(spec.latency)
    contender = Contender(strategy, max_batch_size=spec.max_batch_size)
    cores = [make_core(setup, contender, spec.seed * 1000 + r) for r in range(replicas)]
    arrivals = trace_arrivals(spec)
    measured = sum(1 for a in arrivals if a.time >= spec.warmup_s)
    started = time.perf_counter()
    result = run_replicas(cores, arrivals, make_router(spec.router, spec.seed), stop_at=spec.stop_at,
                          slo_s=spec.slo_s, miss_limit=allowed_misses(measured) if stop_early else None,
                          warmup_s=spec.warmup_s, on_progress=on_progress)
    s = summarize(result, spec.slo_s, spec.warmup_s)
    held = s.offered > 0 and s.p95_s <= spec.slo_s and not result.stopped_early
    return result, Probe(replicas, s.p50_s, s.p95_s, s.p99_s, s.offered, s.completed, s.rejected, s.failed,
                         s.unfinished, s.goodput_frac, held, result.stopped_early, result.steps,
                         time.perf_counter() - started)


ProbeFn = Callable[[str, int, bool], Probe]


def plan_strategy(spec: PlanSpec, strategy: str, probe: ProbeFn | None = None) -> StrategyPlan:
    """The fewest replicas of `strategy` that hold the SLO: climb 1, 2, 4, ... then bisect. `probe(strategy, n,
    stop_early)` simulates one count (default: simulate_fleet); each count is simulated once, except that the
    count just below the answer is simulated again to the end when its first run stopped early."""
    run = probe or (lambda s, n, early: simulate_fleet(spec, s, n, early)[1])
    plan = StrategyPlan(strategy, None)
    seen: dict[int, Probe] = {}

    def held(n: int) -> bool:
        if n not in seen:
            seen[n] = run(strategy, n, True)
        return seen[n].held

    lo, hi = 0, None  # lo: the largest count known to miss (0: none tried); hi: the smallest known to hold
    n = 1
    while True:
        if held(n):
            hi = n
            break
        lo = n
        if n >= spec.max_replicas:
            break
        n = min(2 * n, spec.max_replicas)
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if held(mid):
                hi = mid
            else:
                lo = mid
        plan.replicas = hi
        below = seen.get(hi - 1)
        if below is not None and below.stopped_early:
            seen[hi - 1] = run(strategy, hi - 1, False)
        elif hi > 1 and below is None:
            seen[hi - 1] = run(strategy, hi - 1, False)
    plan.probes = [seen[k] for k in sorted(seen)]
    return plan


def run_plan(spec: PlanSpec, probe: ProbeFn | None = None) -> list[StrategyPlan]:
    return [plan_strategy(spec, s, probe) for s in spec.strategies]


# --- reporting -------------------------------------------------------------------------------------------------
def ms(seconds: float | None) -> float | None:
    """Milliseconds for JSON: None for a latency that is infinite (requests that never completed in time)."""
    return None if seconds is None or not math.isfinite(seconds) else round(seconds * 1000.0, 3)


def _fmt_ms(seconds: float | None, probe: Probe | None = None) -> str:
    if seconds is None:
        return "-"
    if math.isfinite(seconds):
        return f"{seconds * 1000:.1f}"
    if probe is not None and probe.offered:
        lost = (probe.offered - probe.completed) / probe.offered
        return f"inf ({lost:.0%} not completed)" if lost > 0.05 else "inf"
    return "inf"


def table(spec: PlanSpec, plans: list[StrategyPlan]) -> str:
    """One row per strategy: replicas needed, p95 there and its margin to the SLO, p95 at one replica fewer."""
    slo_ms = spec.slo_s * 1000
    head = ("strategy", "replicas", "p95 (ms)", "margin to SLO (ms)", "p95 at one fewer (ms)", "goodput")
    rows = []
    for p in plans:
        if p.replicas is None:
            last = p.at(spec.max_replicas)
            p95 = f"> {slo_ms:g} (run stopped early)" if last and last.stopped_early else _fmt_ms(
                last.p95_s if last else None, last)
            rows.append((p.strategy, f"> {spec.max_replicas}", p95, "missed", "-", "-"))
            continue
        at, below = p.at(p.replicas), p.at(p.replicas - 1)
        margin = slo_ms - at.p95_s * 1000
        if below is None:
            fewer = "-"
        elif below.stopped_early:
            fewer = f"> {slo_ms:g} (run stopped early)"
        else:
            fewer = _fmt_ms(below.p95_s, below)
        good = "-" if at.goodput_frac is None else f"{at.goodput_frac:.1%}"
        rows.append((p.strategy, str(p.replicas), _fmt_ms(at.p95_s), f"+{margin:.1f} ({margin / slo_ms:.0%})",
                     fewer, good))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)])


def probe_lines(plan: StrategyPlan, slo_s: float) -> str:
    """Every count tried for one strategy, in order of replica count."""
    parts = []
    for p in plan.probes:
        mark = "holds" if p.held else "misses"
        p95 = f"> {slo_s * 1000:g} ms (stopped early)" if p.stopped_early else f"{_fmt_ms(p.p95_s, p)} ms"
        parts.append(f"  {p.replicas:>4} {noun_for(p.replicas, 'replica')}: p95 {p95}, {mark}")
    return f"{plan.strategy}:\n" + "\n".join(parts)


def to_json(spec: PlanSpec, plans: list[StrategyPlan], mix_description: str) -> dict:
    def probe(p: Probe) -> dict:
        return {"replicas": p.replicas, "p50_ms": ms(p.p50_s), "p95_ms": ms(p.p95_s), "p99_ms": ms(p.p99_s),
                "held": p.held, "stopped_early": p.stopped_early, "offered": p.offered, "completed": p.completed,
                "rejected": p.rejected, "failed": p.failed, "unfinished": p.unfinished,
                "goodput_frac": p.goodput_frac, "engine_steps": p.steps, "wall_s": round(p.wall_s, 3)}

    out = []
    for p in plans:
        at = p.at(p.replicas) if p.replicas else None
        below = p.at(p.replicas - 1) if p.replicas else None
        out.append({
            "strategy": p.strategy, "replicas": p.replicas,
            "p95_ms": ms(at.p95_s) if at else None,
            "margin_ms": round(spec.slo_s * 1000 - at.p95_s * 1000, 3) if at else None,
            "p95_ms_one_fewer": ms(below.p95_s) if below else None,
            "probes": [probe(x) for x in p.probes],
        })
    return {
        "settings": {"rate_rps": spec.rate_rps, "slo_p95_ms": spec.slo_s * 1000, "router": spec.router,
                     "max_replicas": spec.max_replicas, "duration_s": spec.duration_s, "warmup_s": spec.warmup_s,
                     "stop_at_s": spec.stop_at, "seed": spec.seed, "max_batch_size": spec.max_batch_size,
                     "timeout_s": spec.timeout_s, "mix": mix_description,
                     "latency_model": {k: v for k, v in spec.latency.metadata.items()
                                       if isinstance(v, (str, int, float, bool))}},
        "notes": ["p95 counts refused, failed and unfinished requests as infinitely late; null latency = infinite",
                  "a probe that stopped early had already missed the SLO; its latencies are lower bounds"],
        "strategies": out,
    }
