"""Running contenders: one load run per contender (a fresh target each time), idle latency, saturated capacity.

The same code runs on both clocks: a Driver says how a load runs against a target (live: bench.live; simulated:
sim.drive), everything else (plans, progress, metrics) is here once."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..util.progress import progress as progress_bar
from ..util.words import plural
from .load import LoadResult, Outcome
from .metrics import RunMetrics, Usage, summarize, window_rates
from .results import BatchTimeline, Capacity, IdleLatency
from .targets import OK, Reply, StepSample
from .workload import Mix, RequestSpec, Trace

# Idle latency and capacity are measured without deadlines: their requests carry this explicit timeout, so a
# server's own default (`stepserve serve --timeout-s`) does not apply to them.
NO_DEADLINE_S = 3600.0


@dataclass
class LoadPlan:
    """The load every contender gets: the identical trace (open loop) or the identical per-user sequences."""

    mode: str  # "open" | "closed"
    mix: Mix
    seed: int
    warmup_s: float
    duration_s: float
    drain_s: float
    trace: Trace | None = None  # open loop
    users: int = 0  # closed loop
    rate_rps: float | None = None  # Poisson traces: the rate they were drawn at
    timeout_s: float | None = None  # closed loop: every request's deadline (open loop: already on the trace)
    slo_s: float | None = None  # the run's p95 SLO (a simulated fleet's autoscaler aims at it)

    @property
    def description(self) -> str:
        if self.mode == "open":
            return f"open-loop, {self.trace.description}"
        deadline = f", every request with timeout_s {self.timeout_s:.3g} s" if self.timeout_s is not None else ""
        return f"closed-loop, {plural(self.users, 'user')} for {self.duration_s:g} s (seed {self.seed}){deadline}"


@dataclass
class SampleImage:
    index: int  # position in the trace (the same request under every contender)
    spec: RequestSpec
    image: Any


@dataclass
class ContenderRun:
    metrics: RunMetrics
    timeline: BatchTimeline
    engine_start_s: float
    images: list[SampleImage] = field(default_factory=list)  # only when the target keeps images


@dataclass
class TargetMaker:
    """Builds a fresh target for one run of a contender: a live Target (bench.targets), or on the simulated clock
    the Contender the simulated engine is built from."""

    name: str
    make: Callable[[], Any]


@dataclass
class LoadRun:
    """What running one load plan against one target gave, on the driver's clock."""

    result: LoadResult
    samples: list[StepSample]  # engine steps, when the target reports them (in-process and simulated)
    busy_s: float | None  # time the engine spent in executor steps during the run, when the target can say
    wall_s: float
    usage: Usage
    engine_start_s: float = 0.0
    fleet: Any = None  # simulated fleets: what the fleet did (sim.fleet_run.FleetReport)


class Driver(Protocol):
    """Runs loads against targets on one clock: the wall clock (bench.live.LiveDriver: in-process engines and
    servers) or a simulated one (sim.drive.SimulatedDriver). `seed`: the target's own randomness for this run
    (a simulated executor's noise); a live target has none."""

    async def run(self, maker: TargetMaker, plan: LoadPlan, seed: int, done: Callable[[Outcome], None]) -> LoadRun:
        """A fresh target from `maker`, the plan's load on it, the target stopped; done(outcome) per answer."""
        ...

    async def lone(self, maker: TargetMaker, specs: list[RequestSpec], seed: int,
                   done: Callable[[], None]) -> list[tuple[Reply, float]]:
        """A fresh target, each spec sent alone after the previous answer: (reply, seconds) per spec."""
        ...


async def run_contender(driver: Driver, maker: TargetMaker, plan: LoadPlan, repeat: int, slo_s: float | None,
                        progress: bool = True, label: str = "") -> ContenderRun:
    total = len(plan.trace.items) if plan.mode == "open" else None
    bar = progress_bar(total, label or maker.name, "request", disable=not progress, leave=False, dynamic_ncols=True)
    try:
        ran = await driver.run(maker, plan, plan.seed * 1000 + repeat, lambda _: bar.update(1))
    finally:
        bar.close()
    result, samples = ran.result, ran.samples
    metrics = summarize(result, maker.name, repeat, slo_s, samples, ran.busy_s, ran.wall_s, ran.usage)
    metrics.fleet = getattr(ran, "fleet", None)
    timeline = BatchTimeline(maker.name, [round(s.t - result.start, 4) for s in samples],
                             [s.batch_size for s in samples], [round(s.duration_s, 6) for s in samples])
    images = [SampleImage(o.index, o.spec, o.reply.image) for o in result.outcomes if o.reply.image is not None]
    return ContenderRun(metrics, timeline, ran.engine_start_s, images)


async def measure_idle(driver: Driver, maker: TargetMaker, mix: Mix, samples: int = 3, progress: bool = True,
                       seed: int = 0) -> list[IdleLatency]:
    """Latency of a lone request at each step count of the mix (costliest other settings), nothing else running.
    One unmeasured request per step count first warms the model up."""
    steps_values = sorted({int(s) for s in mix.steps.values})
    specs = []
    for steps in steps_values:
        spec = mix.heaviest(steps)
        spec.timeout_s = NO_DEADLINE_S  # a server's default --timeout-s must not cut the probe short
        specs += [replace(spec, seed=i) for i in range(samples + 1)]
    bar = progress_bar(len(specs), "idle latency", "request", disable=not progress, leave=False, dynamic_ncols=True)
    try:
        answers = await driver.lone(maker, specs, seed, lambda: bar.update(1))
    finally:
        bar.close()
    out: list[IdleLatency] = []
    for k, steps in enumerate(steps_values):
        mine = answers[k * (samples + 1):(k + 1) * (samples + 1)]
        for reply, _ in mine:
            if reply.status != OK:
                raise ValueError(f"the first lone request ({steps} steps) to {maker.name} failed, so nothing can be "
                                 f"measured: {reply.error}")
        times = [seconds for _, seconds in mine[1:]]
        out.append(IdleLatency(steps, statistics.median(times), len(times)))
    return out


async def measure_capacity(driver: Driver, maker: TargetMaker, mix: Mix, users: int, duration_s: float,
                           warmup_s: float, seed: int, progress: bool = True) -> Capacity:
    """Saturated throughput: a closed loop with more users than batch slots, so a request always waits."""
    plan = LoadPlan("closed", mix, seed, warmup_s, duration_s, drain_s=0.0, users=users, timeout_s=NO_DEADLINE_S)
    bar = progress_bar(None, f"capacity ({maker.name})", "request", disable=not progress, leave=False,
                       dynamic_ncols=True)
    try:
        ran = await driver.run(maker, plan, seed, lambda _: bar.update(1))
    finally:
        bar.close()
    completed = sum(1 for o in ran.result.measured if o.status == OK)
    return Capacity(maker.name, window_rates(ran.result, None).throughput_rps, users, duration_s, completed)


def rotate(items: list, k: int) -> list:
    """Contender order for repeat k: rotated, so no contender always runs first (or last) on a drifting machine."""
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]
