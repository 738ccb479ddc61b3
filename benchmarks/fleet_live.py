"""The fleet live: simulated replicas (`serve --model fake --latency-model FILE`) behind Ray Serve's real proxy,
router and controller, each router on the same seeded trace, and the simulator on that trace beside it.

A cell is (curve, replicas, load, seed). Its trace: Poisson arrivals at `load` x the fleet's capacity (replicas x
one engine's, measured by the simulated bench's closed loop, as benchmarks/fleet_matrix.py does), steps drawn
from 4/20/50, every request at the curve's reference size, no adapters. The first 10% of the arrivals are served
and not counted. For each router:

- live: `stepserve serve --model fake --latency-model CURVE --replicas N --router R` on loopback (one thread and
  0.1 CPU reserved per replica, the default strategy, max batch 8, no deadline, max_ongoing_requests 64); the
  bench's open-loop load generator (stepserve.bench.load, HttpTarget: it sends each request's steps and size in the
  x-stepserve-* headers, so the router prices it at its own work) replays the trace through Ray's proxy;
- simulated: the same trace on a simulated fleet (stepserve.sim) running the same router over stats published
  every 0.5 s (Ray's routing-stats period here) plus what it sent since; power_of_two reads each replica's count
  fresh, as Ray's own router probes the replicas it draws.

Printed per cell: each router's live and simulated p95 (all requests; an unfinished one counts as infinitely
late), live/sim, completed share, and each router's live p95 over power_of_two's. One JSON line per router run is
appended to --out as it finishes, so a long matrix can be stopped and resumed (--resume skips the rows there).

    python benchmarks/fleet_live.py --curves gpu-1024-compute-bound --replicas 8 --loads 0.8 --duration 300
    python benchmarks/fleet_live.py --curves gpu-sd15-512 --replicas 8,16 --loads 0.7,0.9 --seeds 0,1,2 \\
        --routers least_work,least_outstanding
    python benchmarks/fleet_live.py --summarize [--markdown] --out bench-out/fleet-live.jsonl
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

from common import ROOT, free_port, stop_server, wait_until_healthy

from stepserve.bench.choice import Choice
from stepserve.bench.load import run_open_loop
from stepserve.bench.resources import git_commit
from stepserve.bench.runner import measure_capacity
from stepserve.bench.targets import Contender, HttpTarget
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.costs import LatencyModel
from stepserve.fleet.routers import make_router
from stepserve.scheduling import DEFAULT_STRATEGY
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker, make_core
from stepserve.sim.fleet import Fleet
from stepserve.sim.loop import Arrival
from stepserve.bench.metrics import percentile
from stepserve.sim.replicas import run_replicas, summarize

CURVES = ("gpu-1024-compute-bound", "gpu-sd15-512")
ROUTERS = ("least_work", "least_work_sampled", "power_of_two", "least_outstanding")
MAX_BATCH, WARMUP_FRAC, STATS_PERIOD_S = 8, 0.1, 0.5


def curve_file(name: str) -> Path:
    return ROOT / "stepserve/models/latency" / f"{name}.json"


def trace_of(curve: str, replicas: int, load: float, seed: int, duration_s: float):
    """(the trace, one engine's capacity in requests per second) of a cell."""
    latency = LatencyModel.load(curve_file(curve))
    mix = Mix(steps=Choice([4, 20, 50], [1.0, 1.0, 1.0]))
    setup, contender = SimSetup(latency), Contender(DEFAULT_STRATEGY, max_batch_size=MAX_BATCH)
    capacity = asyncio.run(measure_capacity(SimulatedDriver(setup), contender_maker(contender), mix,
                                            2 * MAX_BATCH, 300.0, 30.0, seed, progress=False)).rps
    return poisson_trace(mix, load * replicas * capacity, duration_s, seed), capacity


def simulated(curve: str, replicas: int, router: str, trace, seed: int, warmup_s: float, blind: bool = False) -> dict:
    latency = LatencyModel.load(curve_file(curve))
    setup, contender = SimSetup(latency), Contender(DEFAULT_STRATEGY, max_batch_size=MAX_BATCH)
    period = 0.0 if router == "power_of_two" else STATS_PERIOD_S
    fleet = Fleet(make_router(router, seed), latency, publish_every_s=period, blind=blind)
    cores = [make_core(setup, contender, seed * 1000 + r) for r in range(replicas)]
    arrivals = [Arrival(it.offset_s, it.spec.to_params()) for it in trace.items]
    s = summarize(run_replicas(cores, arrivals, fleet), warmup_s=warmup_s)
    return {"p50_s": s.p50_s, "p95_s": s.p95_s, "measured": s.offered, "completed": s.completed}


def start(curve: str, replicas: int, router: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--model", "fake", "--latency-model",
           str(curve_file(curve)), "--port", str(port), "--replicas", str(replicas), "--replica-cpus", "0.1",
           "--threads", "1", "--router", router, "--max-batch-size", str(MAX_BATCH), "--max-ongoing-requests", "64",
           "--timeout-s", "none", "--state", "memory", "--log-level", "warning", "--no-access-log"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = open(log, "a")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, f"{replicas} x {router}", timeout_s=600, poll_s=1.0, log=log)
    return proc, url


def live(url: str, trace, warmup_s: float, drain_s: float, say_work: bool = True) -> dict:
    async def run():
        target = HttpTarget(url, say_work=say_work)
        await target.start()
        try:
            return await run_open_loop(target, trace, warmup_s, drain_s)
        finally:
            await target.stop()

    measured = asyncio.run(run()).measured
    done = [o.latency_s for o in measured if o.latency_s is not None]
    everything = sorted(done + [float("inf")] * (len(measured) - len(done)))  # unfinished or failed: infinitely late
    return {"p50_s": percentile(everything, 50) if everything else float("inf"),
            "p95_s": percentile(everything, 95) if everything else float("inf"),
            "measured": len(measured), "completed": len(done)}


def run_cell(args, curve: str, replicas: int, load: float, seed: int, routers: list[str], done: set) -> list[dict]:
    trace, capacity = trace_of(curve, replicas, load, seed, args.duration)
    warmup_s = WARMUP_FRAC * args.duration
    rows = []
    turn = sum(map(ord, f"{curve}{replicas}{load}{seed}")) % len(routers)  # each cell its own order of routers
    for router in routers[turn:] + routers[:turn]:
        key = (curve, replicas, load, seed, router + args.tag)
        if key in done:
            continue
        row = {"curve": curve, "replicas": replicas, "load": load, "seed": seed, "router": router + args.tag,
               "requests": len(trace.items), "capacity_rps": round(capacity, 4), "duration_s": args.duration,
               "commit": git_commit()}  # the code the fleet ran (its replicas import this checkout)
        t0 = time.perf_counter()
        row["sim"] = simulated(curve, replicas, router, trace, seed, warmup_s, args.no_work_headers)
        proc, url = start(curve, replicas, router, args.out.with_suffix(".log"))
        try:
            time.sleep(args.settle)  # every replica has published its stats at least once
            row["live"] = live(url, trace, warmup_s, args.drain, not args.no_work_headers)
        finally:
            stop_server(proc, grace_s=120)
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(line(row), flush=True)
        rows.append(row)
    return rows


def line(row: dict) -> str:
    lv, sm = row["live"], row["sim"]
    return (f"{row['curve']:<24} {row['replicas']:>3} {row['load']:>4} s{row['seed']} {row['router']:<19} "
            f"live p95 {lv['p95_s']:8.3f} s  sim {sm['p95_s']:8.3f} s  live/sim {ratio(lv['p95_s'], sm['p95_s']):5.2f}  "
            f"done {lv['completed']}/{lv['measured']}  [{row['wall_s']:.0f} s]")


def summarize_rows(rows: list[dict], markdown: bool = False) -> None:
    """Per cell: each router's live and simulated p95, live/sim, and its live p95 over power_of_two's live p95
    (the simulated ratio beside it); `markdown`: as the rows of a Markdown table."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["curve"], r["replicas"], r["load"], r["seed"]), {})[r["router"]] = r
    if markdown:
        print("| curve | replicas | load | seed | router | live p95 (s) | sim p95 (s) | live / sim | completed | "
              "/ power_of_two live (sim) |\n|---|---|---|---|---|---|---|---|---|---|")
    else:
        print(f"\n{'curve':<24} {'reps':>4} {'load':>4} {'seed':>4} {'router':<19} {'live p95':>9} {'sim p95':>9} "
              f"{'live/sim':>8} {'done':>6} {'x pow2 live':>11} {'x pow2 sim':>10}")
    for key, by in sorted(cells.items()):
        for name in sorted(by, key=lambda n: (ROUTERS.index(n.split("-")[0]) if n.split("-")[0] in ROUTERS else 9, n)):
            r = by[name]
            tag = name[len(name.split("-")[0]):]
            base = by.get("power_of_two" + tag) or by.get("power_of_two")  # a tagged run against its own kind
            lv, sm = r["live"]["p95_s"], r["sim"]["p95_s"]
            x_live = ratio(lv, base["live"]["p95_s"]) if base else float("nan")
            x_sim = ratio(sm, base["sim"]["p95_s"]) if base else float("nan")
            share = r["live"]["completed"] / max(r["live"]["measured"], 1)
            if markdown:
                print(f"| {key[0]} | {key[1]} | {key[2]:.0%} | {key[3]} | {name} | {lv:.2f} | {sm:.2f} | "
                      f"{ratio(lv, sm):.2f} | {r['live']['completed']}/{r['live']['measured']} | "
                      f"{_x(x_live)} ({_x(x_sim)}) |")
                continue
            print(f"{key[0]:<24} {key[1]:>4} {key[2]:>4} {key[3]:>4} {name:<19} {lv:9.3f} {sm:9.3f} "
                  f"{ratio(lv, sm):8.2f} {share:6.1%} {x_live:11.2f} {x_sim:10.2f}")


def _x(value: float) -> str:
    """A ratio to power of two's, or "-" where the cell ran without power of two."""
    return "-" if value != value else f"{value:.2f}"


def ratio(a: float, b: float) -> float:
    return a / b if b not in (0, float("inf")) else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--curves", default=",".join(CURVES))
    p.add_argument("--replicas", default="8,16")
    p.add_argument("--loads", default="0.7,0.9")
    p.add_argument("--seeds", default="0")
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals per cell")
    p.add_argument("--drain", type=float, default=600.0,
                   help="seconds to wait for answers after the last send (the simulation waits for every one)")
    p.add_argument("--settle", type=float, default=3.0, help="seconds between the fleet answering and the load")
    p.add_argument("--out", type=Path, default=Path("bench-out/fleet-live.jsonl"))
    p.add_argument("--resume", action="store_true", help="skip the runs already in --out")
    p.add_argument("--no-work-headers", action="store_true",
                   help="the load sends no x-stepserve-steps / -size headers (a client that says nothing): the live "
                        "router prices every request at the default steps and size, and so does the simulated one")
    p.add_argument("--tag", default="", help="appended to each router's name in --out (e.g. '-blind')")
    p.add_argument("--summarize", action="store_true", help="only print the table of the runs in --out")
    p.add_argument("--markdown", action="store_true", help="with --summarize: the table in Markdown")
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = [json.loads(x) for x in args.out.read_text().splitlines() if x.strip()] if args.out.exists() else []
    if args.summarize:
        summarize_rows(old, args.markdown)
        return
    if not args.resume and old:
        raise SystemExit(f"{args.out} has runs already: --resume to add to them, or another --out")
    done = {(r["curve"], r["replicas"], r["load"], r["seed"], r["router"]) for r in old}
    routers = [r for r in args.routers.split(",") if r]
    rows = list(old)
    for curve in args.curves.split(","):
        for replicas in [int(x) for x in args.replicas.split(",")]:
            for load in [float(x) for x in args.loads.split(",")]:
                for seed in [int(x) for x in args.seeds.split(",")]:
                    rows += run_cell(args, curve, replicas, load, seed, routers, done)
    summarize_rows(rows)


if __name__ == "__main__":
    main()
