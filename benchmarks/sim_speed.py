"""How fast `stepserve simulate` replays a long trace: 100k requests, continuous batching, one engine.

The latency model is the fake executor's cost model (LatencyModel.from_cost_model), the mix 8/20/40 steps, the
rate 70% of the simulated capacity, so the queue stays short and the time goes into the engine's steps. It
prints the requests simulated, the simulated seconds, the wall time of the replay and of the bench metrics on
it, and a JSON line. The target is well under 30 s of wall time on two CPU cores.

    python benchmarks/sim_speed.py [--requests 100000] [--rate-frac 0.7] [--max-batch-size 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from stepserve.bench.runner import LoadPlan, measure_capacity, run_contender
from stepserve.bench.targets import Contender
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.costs import CostModel, LatencyModel
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--rate-frac", type=float, default=0.7)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    latency = LatencyModel.from_cost_model(CostModel())
    driver = SimulatedDriver(SimSetup(latency, source="the fake executor's cost model"))
    mix = Mix.from_steps([8, 20, 40])
    contender = Contender("continuous", max_batch_size=args.max_batch_size)
    maker = contender_maker(contender)
    capacity = asyncio.run(measure_capacity(driver, maker, mix, 2 * args.max_batch_size, 60.0, 5.0, args.seed,
                                            progress=False))
    rate = args.rate_frac * capacity.rps
    trace = poisson_trace(mix, rate, args.requests / rate, args.seed)
    plan = LoadPlan("open", mix, args.seed, 0.0, trace.duration_s, 5.0, trace=trace, rate_rps=rate)

    t0 = time.perf_counter()
    run = asyncio.run(run_contender(driver, maker, plan, 0, None, progress=False))
    wall = time.perf_counter() - t0
    m = run.metrics
    print(f"capacity {capacity.rps:.2f} req/s; rate {rate:.2f} req/s; {len(trace.items)} requests over "
          f"{trace.duration_s:.0f} simulated s")
    print(f"completed {m.counts.completed}/{m.counts.offered}, p50 {m.latency.p50:.3f} s, p95 {m.latency.p95:.3f} s, "
          f"{len(run.timeline.t_s)} engine steps")
    print(f"wall time: {wall:.1f} s ({len(trace.items) / wall:.0f} requests/s)")
    print(json.dumps({"requests": len(trace.items), "simulated_s": round(trace.duration_s, 1),
                      "steps": len(run.timeline.t_s), "wall_s": round(wall, 2)}))


if __name__ == "__main__":
    main()
