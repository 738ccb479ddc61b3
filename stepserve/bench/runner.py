"""Running contenders: one load run per contender (a fresh target each time), idle latency, saturated capacity."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..progress import progress as progress_bar
from .load import LoadResult, Outcome, run_closed_loop, run_open_loop
from .metrics import RunMetrics, summarize, window_rates
from .resources import UsageMonitor
from .results import BatchTimeline, Capacity, IdleLatency
from .targets import OK, Target
from .workload import Mix, RequestSpec, Trace, user_requests


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

    @property
    def description(self) -> str:
        if self.mode == "open":
            return f"open-loop, {self.trace.description}"
        deadline = f", every request with timeout_s {self.timeout_s:.3g} s" if self.timeout_s is not None else ""
        return f"closed-loop, {self.users} users for {self.duration_s:g} s (seed {self.seed}){deadline}"


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
    """Builds a fresh target for one run of a contender."""

    name: str
    make: Callable[[], Target]


async def run_contender(maker: TargetMaker, plan: LoadPlan, repeat: int, slo_s: float | None,
                        progress: bool = True, label: str = "") -> ContenderRun:
    target = maker.make()
    t0 = time.monotonic()
    await target.start()
    engine_start_s = time.monotonic() - t0
    total = len(plan.trace.items) if plan.mode == "open" else None
    bar = progress_bar(total, label or maker.name, "req", disable=not progress, leave=False, dynamic_ncols=True)

    def done(_: Outcome) -> None:
        bar.update(1)

    try:
        busy0 = await target.busy_seconds()
        monitor = UsageMonitor().start()
        wall0 = time.monotonic()
        result = await _drive(target, plan, done)
        wall = time.monotonic() - wall0
        usage = monitor.stop()
        busy1 = await target.busy_seconds()
    finally:
        bar.close()
        await target.stop()
    busy_delta = None if busy0 is None or busy1 is None else busy1 - busy0
    samples = target.step_samples()
    metrics = summarize(result, maker.name, repeat, slo_s, samples, busy_delta, wall, usage)
    timeline = BatchTimeline(maker.name, [round(s.t - result.start, 4) for s in samples],
                             [s.batch_size for s in samples])
    images = [SampleImage(o.index, o.spec, o.reply.image) for o in result.outcomes if o.reply.image is not None]
    return ContenderRun(metrics, timeline, engine_start_s, images)


async def _drive(target: Target, plan: LoadPlan, done: Callable[[Outcome], None]) -> LoadResult:
    if plan.mode == "open":
        return await run_open_loop(target, plan.trace, plan.warmup_s, plan.drain_s, done)
    users = [user_requests(plan.mix, plan.seed, u, plan.timeout_s) for u in range(plan.users)]
    return await run_closed_loop(target, users, plan.warmup_s, plan.duration_s, plan.drain_s, done)


async def measure_idle(maker: TargetMaker, mix: Mix, samples: int = 3, progress: bool = True) -> list[IdleLatency]:
    """Latency of a lone request at each step count of the mix (costliest other settings), nothing else running.
    One unmeasured request per step count first warms the model up."""
    steps_values = sorted({int(s) for s in mix.steps.values})
    target = maker.make()
    await target.start()
    out: list[IdleLatency] = []
    bar = progress_bar(len(steps_values) * (samples + 1), "idle latency", "req", disable=not progress, leave=False,
                       dynamic_ncols=True)
    try:
        for steps in steps_values:
            spec = mix.heaviest(steps)
            spec.timeout_s = NO_DEADLINE_S  # a server's default --timeout-s must not cut the probe short
            times = []
            for i in range(samples + 1):
                spec.seed = i
                t0 = time.monotonic()
                reply = await target.send(spec)
                elapsed = time.monotonic() - t0
                bar.update(1)
                if reply.status != OK:
                    raise RuntimeError(f"idle request ({steps} steps) failed: {reply.error}")
                if i > 0:
                    times.append(elapsed)
            out.append(IdleLatency(steps, statistics.median(times), len(times)))
    finally:
        bar.close()
        await target.stop()
    return out


async def measure_capacity(maker: TargetMaker, mix: Mix, users: int, duration_s: float, warmup_s: float,
                           seed: int, progress: bool = True) -> Capacity:
    """Saturated throughput: a closed loop with more users than batch slots, so a request always waits."""
    plan = LoadPlan("closed", mix, seed, warmup_s, duration_s, drain_s=0.0, users=users, timeout_s=NO_DEADLINE_S)
    target = maker.make()
    await target.start()
    bar = progress_bar(None, f"capacity ({maker.name})", "req", disable=not progress, leave=False, dynamic_ncols=True)
    try:
        result = await _drive(target, plan, lambda _: bar.update(1))
    finally:
        bar.close()
        await target.stop()
    completed = sum(1 for o in result.measured if o.status == OK)
    return Capacity(maker.name, window_rates(result, None).throughput_rps, users, duration_s, completed)


def rotate(items: list, k: int) -> list:
    """Contender order for repeat k: rotated, so no contender always runs first (or last) on a drifting machine."""
    if not items:
        return []
    k %= len(items)
    return items[k:] + items[:k]
