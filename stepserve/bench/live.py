"""The bench on the wall clock: loads sent by the asyncio load generators (bench.load) to live targets, in-process
engines or servers, with the process's CPU/GPU usage watched during each run."""

from __future__ import annotations

import time
from collections.abc import Callable

from .load import LoadResult, Outcome, run_closed_loop, run_open_loop
from .resources import UsageMonitor
from .runner import LoadPlan, LoadRun, TargetMaker
from .targets import Reply, Target
from .workload import RequestSpec, user_requests


class LiveDriver:
    """bench.runner.Driver on the wall clock (time.monotonic, the clock of both the event loop and the engine)."""

    async def run(self, maker: TargetMaker, plan: LoadPlan, seed: int, done: Callable[[Outcome], None]) -> LoadRun:
        target: Target = maker.make()
        t0 = time.monotonic()
        try:  # a start interrupted half-way (Ctrl-C, SIGTERM) is stopped too: no peer server left running
            await target.start()
            engine_start_s = time.monotonic() - t0
            busy0 = await target.busy_seconds()
            monitor = UsageMonitor().start()
            wall0 = time.monotonic()
            result = await _load(target, plan, done)
            wall = time.monotonic() - wall0
            usage = monitor.stop()
            busy1 = await target.busy_seconds()
        finally:
            await target.stop()
        busy = None if busy0 is None or busy1 is None else busy1 - busy0
        return LoadRun(result, target.step_samples(), busy, wall, usage, engine_start_s)

    async def lone(self, maker: TargetMaker, specs: list[RequestSpec], seed: int,
                   done: Callable[[], None]) -> list[tuple[Reply, float]]:
        target: Target = maker.make()
        out = []
        try:
            await target.start()
            for spec in specs:
                t0 = time.monotonic()
                reply = await target.send(spec)
                out.append((reply, time.monotonic() - t0))
                done()
        finally:
            await target.stop()
        return out


async def _load(target: Target, plan: LoadPlan, done: Callable[[Outcome], None]) -> LoadResult:
    if plan.mode == "open":
        return await run_open_loop(target, plan.trace, plan.warmup_s, plan.drain_s, done)
    users = [user_requests(plan.mix, plan.seed, u, plan.timeout_s) for u in range(plan.users)]
    return await run_closed_loop(target, users, plan.warmup_s, plan.duration_s, plan.drain_s, done)
