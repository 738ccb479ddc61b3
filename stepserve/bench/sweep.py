"""Rate sweep: offer more and more load (open loop, Poisson) to each contender until its p95 breaks the SLO.

The knee of a contender is the highest rate at which its p95 stayed under the SLO, with every lower rate holding
too. The p95 here counts rejected, failed and unfinished requests as infinitely late, so a contender cannot hold
the SLO by refusing work. Every contender gets the identical trace at each rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from .results import Knee, SweepPoint
from .runner import ContenderRun, LoadPlan, TargetMaker, run_contender
from .workload import Mix, poisson_trace

DEFAULT_SWEEP_FRACS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9,
                       0.95, 1.0, 1.1, 1.2)


def rates_from_fracs(capacity_rps: float, fracs: list[float]) -> list[float]:
    return sorted({round(capacity_rps * f, 4) for f in fracs if f > 0})


def point_from_run(run: ContenderRun, rate: float, slo_s: float) -> SweepPoint:
    m = run.metrics
    held = m.p95_all_s is not None and m.p95_all_s <= slo_s
    return SweepPoint(m.contender, rate, m.counts, m.latency.p50, m.latency.p95, m.p95_all_s, m.throughput_rps,
                      m.goodput_rps, m.slo_attainment, held)


def find_knee(contender: str, points: list[SweepPoint]) -> Knee:
    """Highest rate that held before the first rate that did not."""
    ordered = sorted((p for p in points if p.contender == contender), key=lambda p: p.rate_rps)
    knee = None
    for p in ordered:
        if not p.held:
            break
        knee = p.rate_rps
    top = ordered[-1].rate_rps if ordered else 0.0
    held_at_top = bool(ordered) and all(p.held for p in ordered)
    return Knee(contender, knee, top, held_at_top)


@dataclass
class SweepResult:
    points: list[SweepPoint] = field(default_factory=list)
    knees: list[Knee] = field(default_factory=list)
    runs: list[ContenderRun] = field(default_factory=list)


async def run_sweep(makers: list[TargetMaker], mix: Mix, rates: list[float], slo_s: float, warmup_s: float,
                    duration_s: float, drain_s: float, seed: int, patience: int = 1,
                    progress: bool = True) -> SweepResult:
    """Each contender climbs the rates in order and stops after `patience` rates in a row that broke the SLO."""
    out = SweepResult()
    traces = {rate: poisson_trace(mix, rate, warmup_s + duration_s, seed) for rate in rates}
    outer = tqdm(total=len(makers) * len(rates), desc="sweep", unit="run", disable=not progress,
                 dynamic_ncols=True)
    try:
        for maker in makers:
            misses = 0
            for i, rate in enumerate(rates):
                plan = LoadPlan("open", mix, seed, warmup_s, duration_s, drain_s, trace=traces[rate])
                run = await run_contender(maker, plan, 0, slo_s, progress, label=f"{maker.name} @ {rate:.3g} req/s")
                point = point_from_run(run, rate, slo_s)
                out.points.append(point)
                out.runs.append(run)
                outer.update(1)
                misses = 0 if point.held else misses + 1
                if misses >= patience:
                    outer.update(len(rates) - i - 1)
                    break
            out.knees.append(find_knee(maker.name, out.points))
    finally:
        outer.close()
    return out
