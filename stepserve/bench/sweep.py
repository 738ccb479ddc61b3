"""Rate sweep: offer more and more load (open loop, Poisson) to each contender until its p95 breaks the SLO.

The knee of a contender is the highest rate at which its p95 stayed under the SLO, below every rate at which it
broke. The p95 here counts rejected, failed and unfinished requests as infinitely late, so a contender cannot hold
the SLO by refusing work. At a given rate every contender gets the identical trace (the same seed: the same
requests, with arrival times scaled by the rate).

Two ways to pick the rates: a fixed grid (each contender climbs it and stops at its first miss), or a search
(climb by a factor from a start rate until the first miss, then bisect between the last hold and the first miss;
when the start rate already misses, step down first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..util.progress import progress as progress_bar
from .results import Knee, SweepPoint
from .runner import ContenderRun, Driver, LoadPlan, TargetMaker, run_contender
from .workload import Mix, poisson_trace

MAX_DESCENTS = 3  # when the start rate already misses, step down by the factor at most this many times


@dataclass
class SweepSpec:
    grid_rps: list[float] = field(default_factory=list)  # fixed rates; empty: search
    start_rps: float = 1.0  # search: the first rate
    factor: float = 1.5  # search: climb by this factor
    max_rps: float = 100.0  # search: never above this (the knee is then reported as "at least")
    refine: int = 3  # search: bisection steps between the last hold and the first miss
    warmup_s: float = 3.0
    duration_s: float = 15.0
    drain_s: float = 5.0
    seed: int = 0
    min_requests: int = 50  # a point lasts long enough for this many measured requests (a p95 needs samples)
    timeout_s: float | None = None  # every request's deadline, when the benchmark has deadlines


def point_from_run(run: ContenderRun, rate: float, slo_s: float) -> SweepPoint:
    m = run.metrics
    held = m.p95_all_s is not None and m.p95_all_s <= slo_s
    return SweepPoint(m.contender, rate, m.offered_rps, m.counts, m.latency.p50, m.latency.p95, m.p95_all_s,
                      m.throughput_rps, m.goodput_rps, m.slo_attainment, held)


def find_knee(contender: str, points: list[SweepPoint]) -> Knee:
    """The highest rate that held, below the lowest rate that did not."""
    mine = [p for p in points if p.contender == contender]
    first_miss = min((p.rate_rps for p in mine if not p.held), default=math.inf)
    held = [p for p in mine if p.held and p.rate_rps < first_miss]
    knee = max(held, key=lambda p: p.rate_rps) if held else None
    top = max((p.rate_rps for p in mine), default=0.0)
    return Knee(contender, knee.rate_rps if knee else None, knee.offered_rps if knee else None, top,
                bool(mine) and math.isinf(first_miss))


@dataclass
class SweepResult:
    points: list[SweepPoint] = field(default_factory=list)
    knees: list[Knee] = field(default_factory=list)
    runs: list[ContenderRun] = field(default_factory=list)


class _Sweeper:
    def __init__(self, driver: Driver, mix: Mix, spec: SweepSpec, slo_s: float, progress: bool,
                 out: SweepResult) -> None:
        self.driver, self.mix, self.spec, self.slo_s, self.progress, self.out = driver, mix, spec, slo_s, progress, out

    async def point(self, maker: TargetMaker, rate: float) -> bool:
        s = self.spec
        duration = max(s.duration_s, s.min_requests / rate)
        trace = poisson_trace(self.mix, rate, s.warmup_s + duration, s.seed).with_timeout(s.timeout_s)
        plan = LoadPlan("open", self.mix, s.seed, s.warmup_s, duration, s.drain_s, trace=trace)
        run = await run_contender(self.driver, maker, plan, 0, self.slo_s, self.progress,
                                  label=f"{maker.name} @ {rate:.3g} req/s")
        point = point_from_run(run, rate, self.slo_s)
        self.out.points.append(point)
        self.out.runs.append(run)
        return point.held

    async def grid(self, maker: TargetMaker) -> None:
        for rate in sorted(self.spec.grid_rps):
            if not await self.point(maker, rate):
                return

    async def search(self, maker: TargetMaker) -> None:
        s = self.spec
        lo, hi, rate = None, None, s.start_rps
        while rate <= s.max_rps * (1 + 1e-9):
            if await self.point(maker, rate):
                lo, rate = rate, rate * s.factor
                continue
            hi = rate
            break
        for _ in range(MAX_DESCENTS if lo is None and hi is not None else 0):  # missed at the start: go lower
            rate = round(hi / s.factor, 4)
            if await self.point(maker, rate):
                lo = rate
                break
            hi = rate
        if hi is None and lo is not None and lo < s.max_rps:  # climbed past the cap: try the cap itself
            if await self.point(maker, s.max_rps):
                return
            hi = s.max_rps
        if lo is None or hi is None:
            return
        for _ in range(s.refine):
            mid = round(math.sqrt(lo * hi), 4)
            if await self.point(maker, mid):
                lo = mid
            else:
                hi = mid


async def run_sweep(driver: Driver, makers: list[TargetMaker], mix: Mix, spec: SweepSpec, slo_s: float,
                    progress: bool = True) -> SweepResult:
    out = SweepResult()
    sweeper = _Sweeper(driver, mix, spec, slo_s, progress, out)
    bar = progress_bar(len(makers), "sweep", "contender", disable=not progress, dynamic_ncols=True)
    for maker in makers:
        await (sweeper.grid(maker) if spec.grid_rps else sweeper.search(maker))
        out.knees.append(find_knee(maker.name, out.points))
        bar.update(1)
    bar.close()
    return out
