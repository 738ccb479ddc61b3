"""How fast `stepserve simulate` replays a long trace: 100k requests, continuous batching, one engine; or a fleet.

The latency model is the fake executor's cost model (LatencyModel.from_cost_model), the mix 8/20/40 steps, the
rate 70% of the simulated capacity, so the queue stays short and the time goes into the engine's steps. It
prints the requests simulated, the simulated seconds, the wall time of the replay and of the bench metrics on
it, and a JSON line. The target is well under 30 s of wall time on two CPU cores.

The fleet case (--replicas N): N replicas of --strategy (default: the default strategy) behind --router, --minutes
of Poisson traffic at --rate-frac of the fleet's capacity on --latency-model (default the SD 1.5-class GPU
curve), mixed 4/20/50 steps; it prints the requests, engine steps, the wall and CPU seconds of the replay and
where the CPU time went (the engines' steps, the routing). The target: 64 replicas x 10 minutes at 80% load in
under 60 s.

    python benchmarks/sim_speed.py [--requests 100000] [--rate-frac 0.7] [--max-batch-size 8]
    python benchmarks/sim_speed.py --replicas 64 --minutes 10 --rate-frac 0.8 [--router least_work]
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
    p.add_argument("--replicas", type=int, default=1, help="more than 1: the fleet case")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--router", default="least_work")
    p.add_argument("--strategy", default=None)
    p.add_argument("--latency-model", default="stepserve/models/latency/gpu-sd15-512.json")
    p.add_argument("--profile", action="store_true", help="the fleet case: where the time goes (slower)")
    args = p.parse_args()
    if args.replicas > 1:
        fleet_case(args)
        return

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



def fleet_case(args) -> None:
    import cProfile
    import pstats
    from pathlib import Path

    from stepserve.fleet.routers import make_router
    from stepserve.scheduling import DEFAULT_STRATEGY
    from stepserve.sim.bench import make_core
    from stepserve.sim.loop import Arrival
    from stepserve.sim.replicas import run_replicas, summarize

    root = Path(__file__).resolve().parent.parent
    latency = LatencyModel.load(root / args.latency_model)
    setup = SimSetup(latency)
    mix = Mix.from_steps([4, 20, 50])
    contender = Contender(args.strategy or DEFAULT_STRATEGY, max_batch_size=args.max_batch_size)
    driver = SimulatedDriver(setup)
    one = asyncio.run(measure_capacity(driver, contender_maker(contender), mix, 2 * args.max_batch_size, 120.0, 20.0,
                                       args.seed, progress=False)).rps
    rate = args.rate_frac * args.replicas * one
    trace = poisson_trace(mix, rate, args.minutes * 60.0, args.seed)
    arrivals = [Arrival(it.offset_s, it.spec.to_params()) for it in trace.items]
    cores = [make_core(setup, contender, r) for r in range(args.replicas)]
    profile = cProfile.Profile() if args.profile else None
    t0, c0 = time.perf_counter(), time.process_time()
    if profile:
        profile.enable()
    result = run_replicas(cores, arrivals, make_router(args.router, args.seed))
    if profile:
        profile.disable()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = summarize(result)
    print(f"{args.replicas} replicas x {args.minutes:g} min at {args.rate_frac:g} of capacity ({rate:.1f} req/s, "
          f"{Path(args.latency_model).name}, {contender.name}, {args.router}): {len(arrivals)} requests, "
          f"{result.steps} engine steps; p95 {s.p95_s:.2f} s, {s.completed} completed")
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s" + (" (profiled)" if profile else ""))
    if profile:
        stats = pstats.Stats(profile)
        spent = {name: sum(v[3] for k, v in stats.stats.items() if k[2] == fn and k[0].endswith(path))
                 for name, (path, fn) in {"engine steps": ("engine/core.py", "step"),
                                          "routing": ("sim/fleet.py", "place")}.items()}
        total = sum(v[2] for v in stats.stats.values())
        print(f"profiled: engine steps {spent['engine steps'] / total:.0%}, routing {spent['routing'] / total:.0%}")
    print(json.dumps({"replicas": args.replicas, "requests": len(arrivals), "steps": result.steps,
                      "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}))


if __name__ == "__main__":
    main()
