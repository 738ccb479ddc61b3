"""Host cost of the engine under a deep queue: does a step cost more when more requests wait?

Two measurements, printed as numbers (nothing asserts on them):

(a) sim: N requests of a Poisson trace at `--overload` times the simulated capacity (continuous batching, the fake
    executor's cost model as latency model, mix 8/20/40 steps), replayed by the simulated bench as
    benchmarks/sim_speed.py does. The queue grows to about (1 - 1/overload) * N, so a step whose cost grows
    with the queue makes the replay quadratic in N. Prints the wall seconds of each replay.
(b) step: the host time of one EngineCore.step (a FakeExecutor charging nothing, so only the engine and the
    policy are timed) with Q requests queued, for every strategy, at Q = 10 and Q = 10,000 (topped up after
    every step so that the depth stays put, queued as admitted requests without the admission rule's own cost,
    which benchmarks/admission_cost.py times; two shape buckets; half of the requests carry a distant deadline).
    Prints microseconds per step (the median of 7 rounds, the depths taking turns) and the ratio deep /
    shallow.

    python benchmarks/host_cost.py [--sim-requests 2000,5000,10000] [--depths 10,10000] [--steps 500]
                                   [--strategies continuous,dynamic,static,none,slo] [--skip-sim] [--skip-step]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from stepserve.bench.runner import LoadPlan, measure_capacity, run_contender
from stepserve.bench.targets import Contender
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.costs import CostModel, LatencyModel
from stepserve.costs.fake import FakeExecutor
from stepserve.engine.core import EngineCore
from stepserve.scheduling import make_policy
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker
from stepserve.request.types import SamplingParams

FREE = CostModel(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def sim_seconds(requests: int, overload: float, strategy: str, max_batch_size: int, seed: int) -> dict:
    latency = LatencyModel.from_cost_model(CostModel())
    driver = SimulatedDriver(SimSetup(latency, source="the fake executor's cost model"))
    mix = Mix.from_steps([8, 20, 40])
    maker = contender_maker(Contender(strategy, max_batch_size=max_batch_size))
    capacity = asyncio.run(measure_capacity(driver, maker, mix, 2 * max_batch_size, 60.0, 5.0, seed,
                                            progress=False))
    rate = overload * capacity.rps
    trace = poisson_trace(mix, rate, requests / rate, seed)
    plan = LoadPlan("open", mix, seed, 0.0, trace.duration_s, 5.0, trace=trace, rate_rps=rate)
    t0 = time.perf_counter()
    run = asyncio.run(run_contender(driver, maker, plan, 0, None, progress=False))
    wall = time.perf_counter() - t0
    return {"requests": len(trace.items), "simulated_s": round(trace.duration_s, 1),
            "steps": len(run.timeline.t_s), "completed": run.metrics.counts.completed, "wall_s": round(wall, 2)}


def _params(i: int, deadlines: bool) -> SamplingParams:
    """Two size buckets, three step counts; with `deadlines`, half the requests carry a (far) deadline."""
    size = 32 if i % 2 else 48
    return SamplingParams(prompt=f"p{i % 7}", seed=i, num_inference_steps=(8, 20, 40)[i % 3], height=size,
                          width=size, timeout_s=1e6 if deadlines and i % 4 < 2 else None)


class _Deep:
    """An engine core kept at `depth` waiting requests (topped up between steps, outside the timing)."""

    def __init__(self, strategy: str, depth: int, max_batch_size: int, deadlines: bool = True) -> None:
        policy = make_policy(strategy, max_batch_size=max_batch_size, max_queue_delay_ms=0.0,
                             static_flush_timeout_s=0.0)
        self.core = EngineCore(FakeExecutor(cost=FREE), policy)
        self.depth, self.n, self.now, self.deadlines = depth, 0, 0.0, deadlines

    def run(self, steps: int) -> float:
        """Mean host seconds of one EngineCore.step over `steps` steps."""
        core, spent = self.core, 0.0
        for _ in range(steps):
            while len(core.waiting) < self.depth:  # queued as admitted: slo's admission rule replays the
                # queue for each arrival (benchmarks/admission_cost.py times it), which is not the step's cost
                core.enqueue(core.new_request(_params(self.n, self.deadlines), self.now))
                self.n += 1
            self.now += 1e-3
            t0 = time.perf_counter()
            core.step(self.now)
            spent += time.perf_counter() - t0
        return spent / steps


def step_us(strategy: str, depths: list[int], steps: int, max_batch_size: int, rounds: int = 7,
            deadlines: bool = True) -> list[float]:
    """Per depth, the median over `rounds` of the mean host microseconds of a step; the depths take turns (each
    round runs `steps` steps at every depth) so that a busy machine weighs on all of them alike."""
    cores = [_Deep(strategy, d, max_batch_size, deadlines) for d in depths]
    for c in cores:
        c.run(max(steps // 10, 1))  # warm up
    means: list[list[float]] = [[] for _ in depths]
    for _ in range(rounds):
        for c, m in zip(cores, means):
            m.append(c.run(steps))
    return [statistics.median(m) * 1e6 for m in means]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim-requests", default="2000,5000,10000")
    p.add_argument("--overload", type=float, default=3.0)
    p.add_argument("--sim-strategy", default="continuous")
    p.add_argument("--depths", default="10,10000")
    p.add_argument("--steps", type=int, default=500, help="steps per round and depth")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--strategies", default="continuous,dynamic,static,none,slo")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--skip-step", action="store_true")
    p.add_argument("--no-deadlines", action="store_true", help="step: no request carries a deadline (default: half)")
    args = p.parse_args()
    out: dict = {}
    if not args.skip_sim:
        out["sim"] = []
        for n in [int(x) for x in args.sim_requests.split(",")]:
            row = sim_seconds(n, args.overload, args.sim_strategy, args.max_batch_size, args.seed)
            out["sim"].append(row)
            print(f"sim {args.sim_strategy} {args.overload:g}x overload: {row['requests']} requests "
                  f"({row['simulated_s']} simulated s, {row['steps']} steps) in {row['wall_s']} s", flush=True)
    if not args.skip_step:
        depths = [int(x) for x in args.depths.split(",")]
        out["step_us"] = {}
        for strategy in args.strategies.split(","):
            times = step_us(strategy, depths, args.steps, args.max_batch_size, args.rounds, not args.no_deadlines)
            out["step_us"][strategy] = {str(d): round(t, 1) for d, t in zip(depths, times)}
            cells = "  ".join(f"{d} queued: {t:8.1f} us" for d, t in zip(depths, times))
            print(f"step {strategy:>10}: {cells}  ratio {times[-1] / times[0]:.2f}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
