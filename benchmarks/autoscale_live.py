"""Autoscaling live: the SLO policy against Ray Serve's default policy (target_ongoing_requests at several values)
on a fleet of simulated replicas (`serve --model fake --latency-model CURVE --autoscale 1:8`) behind Ray's real
proxy, router, controller and autoscaler, with real replica start-up, and the simulator on the same trace beside it.

The trace is benchmarks/autoscale_sim.py's step scaled to at most 8 replicas: Poisson arrivals whose rate steps
from 0.2 to 0.8 to 0.2 of 8 replicas' capacity (--fracs), --phase-s seconds each, steps 4/20/50; every policy
starts from 3 replicas, may run 1 to 8, and routes with least_work (the simulation over stats 0.5 s old, as live). The SLO is 2 x the idle latency of a 50-step request (the bench's rule).

Per policy: SLO attainment (requests answered within the SLO, over all of them), p95, replica-seconds and the most
replicas, live and simulated. Live replica-seconds integrate the replicas that answer /metrics, polled every 2 s
from the first request until the last answer (a replica still starting is not counted: a few seconds each);
the simulation pays --startup-s for every replica it starts (about what a simulated replica takes here).

    python benchmarks/autoscale_live.py [--phase-s 120] [--targets 1,2,4] [--out bench-out/autoscale-live]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from autoscale_sim import run_one, step_trace
from common import ROOT, free_port, stop_server, wait_until_healthy
from ray_autoscale import count_replicas

from stepserve.bench.load import run_open_loop
from stepserve.bench.metrics import percentile
from stepserve.bench.runner import measure_capacity
from stepserve.bench.targets import Contender, HttpTarget
from stepserve.bench.workload import Mix
from stepserve.costs import LatencyModel
from stepserve.fleet.autoscale import SLOScaling
from stepserve.scheduling import DEFAULT_STRATEGY
from stepserve.sim.autoscale import RayDefault
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker
from stepserve.sim.loop import Arrival

MAX_REPLICAS, START = 8, 3
STATS_PERIOD_S = 0.5  # the live router's stats are this old (server/ray/router.py): so are the simulated ones


def live(curve: Path, policy_flags: list[str], trace, slo_s: float, log: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--model", "fake", "--latency-model", str(curve),
           "--port", str(port), "--replicas", str(START), "--autoscale", f"1:{MAX_REPLICAS}", "--replica-cpus",
           "0.2", "--threads", "1", "--router", "least_work", "--max-batch-size", "8", "--timeout-s", "none",
           "--state", "memory", "--log-level", "warning", "--no-access-log", *policy_flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, " ".join(policy_flags), timeout_s=600, poll_s=1.0, log=log)
        return asyncio.run(_drive(url, trace, slo_s))
    finally:
        stop_server(proc, grace_s=120)


async def _drive(url: str, trace, slo_s: float) -> dict:
    counts: list[tuple[float, int]] = []
    target = HttpTarget(url)
    await target.start()
    finished = asyncio.Event()
    start = time.monotonic()

    async def poll() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            while not finished.is_set():
                n = await count_replicas(client)
                counts.append((time.monotonic() - start, n if n is not None else (counts[-1][1] if counts else 0)))
                try:
                    await asyncio.wait_for(finished.wait(), 2.0)
                except asyncio.TimeoutError:
                    pass

    poller = asyncio.ensure_future(poll())
    try:
        result = await run_open_loop(target, trace, 0.0, 300.0)
    finally:
        finished.set()
        await poller
        await target.stop()
    end = time.monotonic() - start
    replica_s = sum(n * ((counts[i + 1][0] if i + 1 < len(counts) else end) - t) for i, (t, n) in enumerate(counts))
    latencies = sorted(o.latency_s if o.latency_s is not None else float("inf") for o in result.outcomes)
    within = sum(1 for v in latencies if v <= slo_s)
    return {"attainment": within / len(latencies), "p95_s": percentile(latencies, 95),
            "replica_s": round(replica_s, 1), "most_replicas": max(n for _, n in counts), "replicas": counts,
            "completed": sum(1 for v in latencies if v != float("inf")), "offered": len(latencies)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency-model", type=Path, default=ROOT / "stepserve/models/latency/gpu-1024-compute-bound.json")
    p.add_argument("--phase-s", type=float, default=120.0)
    p.add_argument("--fracs", default="0.2,0.8,0.2",
                   help="each phase's rate, as a fraction of 8 replicas' capacity (autoscale_sim.py's 0.3/1.2/0.3 with "
                        "at most 12 replicas, scaled to at most 8)")
    p.add_argument("--targets", default="1,2,4", help="Ray's target_ongoing_requests values to try")
    p.add_argument("--startup-s", type=float, default=8.0, help="the simulation's replica start-up")
    p.add_argument("--policies", default="", help="only these (e.g. 'slo,ray 2'); default: slo and every target")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out/autoscale-live"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    latency = LatencyModel.load(args.latency_model)
    setup, contender = SimSetup(latency), Contender(DEFAULT_STRATEGY, max_batch_size=8)
    mix = Mix.from_steps([4, 20, 50])
    driver = SimulatedDriver(setup)
    capacity = asyncio.run(measure_capacity(driver, contender_maker(contender), mix, 16, 600.0, 60.0, args.seed,
                                            progress=False)).rps
    idle = asyncio.run(driver.lone(contender_maker(contender), [mix.heaviest(50)], 0, lambda: None))[0][1]
    slo_s = 2.0 * idle
    rates = [float(f) * MAX_REPLICAS * capacity for f in args.fracs.split(",")]
    trace = step_trace(mix, rates, args.phase_s, args.seed)
    arrivals = [Arrival(it.offset_s, it.spec.to_params()) for it in trace.items]
    print(f"{args.latency_model.name}: capacity {capacity:.3f} req/s per replica; SLO {slo_s:.2f} s; rates "
          f"{', '.join(f'{r:.2f}' for r in rates)} req/s, {args.phase_s:g} s each; {len(arrivals)} requests",
          flush=True)
    policies = {"slo": (["--slo-p95-ms", str(slo_s * 1000)], SLOScaling(slo_s, 1, MAX_REPLICAS))}  # the rule as live
    for t in args.targets.split(","):
        policies[f"ray {t}"] = (["--target-ongoing-requests", t], RayDefault(float(t), 1, MAX_REPLICAS))
    chosen = [x.strip() for x in args.policies.split(",") if x.strip()] or list(policies)
    rows = {}
    for name in chosen:
        flags, rule = policies[name]
        sim = run_one(setup, contender, arrivals, rule, args.startup_s, START, slo_s, STATS_PERIOD_S)
        sim.pop("wall_s")
        got = live(args.latency_model, flags, trace, slo_s, args.out / "server.log")
        rows[name] = {"live": got, "sim": sim}
        print(f"{name:<8} live: attainment {got['attainment']:.3f} p95 {got['p95_s']:7.2f} s "
              f"replica-s {got['replica_s']:7.0f} most {got['most_replicas']} | sim: attainment "
              f"{sim['attainment']:.3f} p95 {sim['p95_s']:7.2f} s replica-s {sim['replica_s']:7.0f} most "
              f"{sim['most_replicas']}", flush=True)
        (args.out / "autoscale-live.json").write_text(json.dumps(
            {"latency_model": args.latency_model.name, "capacity_rps": capacity, "slo_s": slo_s, "rates": rates,
             "phase_s": args.phase_s, "startup_s": args.startup_s, "rows": rows}, indent=1, default=str) + "\n")
    print(f"wrote {args.out / 'autoscale-live.json'}")


if __name__ == "__main__":
    main()
