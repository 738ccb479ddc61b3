"""The simulated fleet matrix: routers against each other and against a central queue, on the GPU curves of
stepserve/models/latency and the embedded model's CPU profile.

Every cell: a seeded Poisson trace at 70% or 90% of the fleet's capacity (8 or 32 replicas; capacity = replicas x
one engine's, measured by the simulated bench's closed loop), mixed 4/20/50 steps, 20% of requests naming one of
10 adapters (a replica holds 4; loading one costs ten denoising steps at batch 1), the default strategy (slo) on
every replica, max batch 8. The same trace goes to every router; the first 10% of arrivals are served but not
counted. Printed per cell: the p95 of each router, and least_work's p95 over power_of_two's, least_outstanding's
and the central queue's.

The central queue: no router; one queue in front of all replicas, and a replica is sent a request only while it
holds fewer than `hold` (the smallest batch whose throughput is within 5% of the best the curve allows up to the
max batch: 1 where a batch of n costs n steps of one, the max batch where batching is cheap), the least loaded of
those that can take one, in arrival order.

    python benchmarks/fleet_matrix.py [--curves gpu-1024-compute-bound,...] [--replicas 8,32] [--loads 0.7,0.9]
        [--seed 0] [--adapter-share 0.2] [--duration S] [--out fleet-matrix.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from stepserve.bench.runner import measure_capacity
from stepserve.bench.targets import Contender
from stepserve.bench.choice import Choice
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.costs import LatencyModel
from stepserve.fleet.routers import make_router
from stepserve.scheduling import DEFAULT_STRATEGY
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker, make_core
from stepserve.sim.fleet import Fleet
from stepserve.sim.loop import Arrival
from stepserve.sim.replicas import run_replicas, summarize

ROOT = Path(__file__).resolve().parent.parent
CURVES = {  # name: (file, seconds of arrivals per cell, where batching costs)
    "gpu-1024-compute-bound": ("gpu-1024-compute-bound.json", 1200.0, True),
    "gpu-512-sublinear": ("gpu-512-sublinear.json", 1200.0, False),
    "gpu-sd15-512": ("gpu-sd15-512.json", 300.0, False),
    "embedded-cpu": ("embedded-cpu.json", 30.0, False),
}
ROUTERS = ("least_work", "power_of_two", "least_outstanding")
ADAPTERS, ADAPTER_SHARE, ADAPTER_SLOTS = 10, 0.2, 4
MAX_BATCH = 8


def mix(share: float = ADAPTER_SHARE) -> Mix:
    names = ["none"] + [f"style-{i}" for i in range(ADAPTERS)]
    return Mix(steps=Choice([4, 20, 50], [1.0, 1.0, 1.0]),
               lora=Choice(names, [1 - share] + [share / ADAPTERS] * ADAPTERS))


def central_hold(latency: LatencyModel) -> int:
    best = max(b / latency.step_s(b) for b in range(1, MAX_BATCH + 1))
    return next(b for b in range(1, MAX_BATCH + 1) if b / latency.step_s(b) >= 0.95 * best)


def arrivals(m: Mix, rate: float, duration_s: float, seed: int) -> list[Arrival]:
    out = []
    for it in poisson_trace(m, rate, duration_s, seed).items:
        params = it.spec.to_params()
        adapter = params.loras[0]["name"] if params.loras else None
        params.loras = None
        out.append(Arrival(it.offset_s, params, adapter=adapter))
    return out


def cell(name: str, replicas: int, load: float, seed: int, share: float = ADAPTER_SHARE,
         duration_s: float | None = None) -> dict:
    file, duration, costly = CURVES[name]
    duration = duration_s or duration
    latency = LatencyModel.load(ROOT / "stepserve/models/latency" / file)
    setup, contender = SimSetup(latency), Contender(DEFAULT_STRATEGY, max_batch_size=MAX_BATCH)
    m = mix(share)
    capacity = asyncio.run(measure_capacity(SimulatedDriver(setup), contender_maker(contender), Mix(steps=m.steps),
                                            2 * MAX_BATCH, 300.0 if costly else 60.0, 30.0, seed, progress=False))
    rate = load * replicas * capacity.rps
    trace = arrivals(m, rate, duration, seed)
    load_s = 10 * latency.step_s(1)
    out = {"curve": name, "replicas": replicas, "load": load, "batching_costs": costly, "requests": len(trace),
           "capacity_rps": round(capacity.rps, 4), "adapter_load_s": round(load_s, 4), "p95_s": {}, "p50_s": {},
           "adapter_loads": {}, "wall_s": {}}
    fleets = {r: Fleet(make_router(r, seed, load_s), latency, adapter_load_s=load_s, adapter_slots=ADAPTER_SLOTS)
              for r in ROUTERS}
    hold = central_hold(latency)
    fleets[f"central (hold {hold})"] = Fleet(None, latency, adapter_load_s=load_s, adapter_slots=ADAPTER_SLOTS,
                                             central_hold=hold)
    for label, fleet in fleets.items():
        cores = [make_core(setup, contender, seed * 1000 + r) for r in range(replicas)]
        t0 = time.perf_counter()
        s = summarize(run_replicas(cores, trace, fleet), warmup_s=0.1 * duration)
        out["p95_s"][label], out["p50_s"][label] = round(s.p95_s, 4), round(s.p50_s, 4)
        out["adapter_loads"][label] = fleet.adapter_loads
        out["wall_s"][label] = round(time.perf_counter() - t0, 1)
    p95 = out["p95_s"]
    central = next(v for k, v in p95.items() if k.startswith("central"))
    out["ratios"] = {"vs_power_of_two": round(p95["least_work"] / p95["power_of_two"], 3),
                     "vs_least_outstanding": round(p95["least_work"] / p95["least_outstanding"], 3),
                     "vs_central": round(p95["least_work"] / central, 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--curves", default=",".join(CURVES))
    p.add_argument("--replicas", default="8,32")
    p.add_argument("--loads", default="0.7,0.9")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--adapter-share", type=float, default=ADAPTER_SHARE,
                   help="the share of requests naming an adapter (0: none, as in the live two-replica check)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per cell (default: the curve's)")
    p.add_argument("--out", type=Path, default=Path("fleet-matrix.json"))
    p.add_argument("--plot", type=Path, help="only draw the matrix in --out as this PNG")
    p.add_argument("--staleness", help="instead of the matrix: least_work's p95 when the replicas publish their "
                                       "stats every P seconds, for each P given (e.g. 0,0.5,2,10)")
    args = p.parse_args()
    if args.plot:
        plot(json.loads(args.out.read_text())["cells"], args.plot)
        return
    if args.staleness:
        periods = [float(x) for x in args.staleness.split(",")]
        for name in args.curves.split(","):
            for replicas in [int(x) for x in args.replicas.split(",")]:
                for load in [float(x) for x in args.loads.split(",")]:
                    p95 = staleness(name, replicas, load, args.seed, periods)
                    print(f"{name} {replicas} x {load:.0%}: " + ", ".join(
                        f"every {t:g} s: p95 {v:.3f} s ({v / p95[0]:.2f}x)" for t, v in zip(periods, p95)),
                          flush=True)
        return
    rows = []
    print(f"{'curve':<24} {'reps':>4} {'load':>4} {'least_work':>10} {'pow2':>8} {'least_out':>9} {'central':>8}   "
          f"lw/pow2  lw/lo  lw/central", flush=True)
    for name in args.curves.split(","):
        for replicas in [int(x) for x in args.replicas.split(",")]:
            for load in [float(x) for x in args.loads.split(",")]:
                row = cell(name, replicas, load, args.seed, args.adapter_share, args.duration)
                rows.append(row)
                p95 = list(row["p95_s"].values())
                r = row["ratios"]
                print(f"{name:<24} {replicas:>4} {load:>4} {p95[0]:>10.3f} {p95[1]:>8.3f} {p95[2]:>9.3f} "
                      f"{p95[3]:>8.3f}   {r['vs_power_of_two']:>7.2f} {r['vs_least_outstanding']:>6.2f} "
                      f"{r['vs_central']:>10.2f}  [{sum(row['wall_s'].values()):.0f} s]", flush=True)
                args.out.write_text(json.dumps({"seed": args.seed, "cells": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


def staleness(name: str, replicas: int, load: float, seed: int, periods: list[float]) -> list[float]:
    """least_work's p95 on one cell's trace, the replicas' stats published every period (0: read fresh), the
    router adding what it sent since (fleet/sent.py), as in Ray Serve."""
    file, duration, costly = CURVES[name]
    latency = LatencyModel.load(ROOT / "stepserve/models/latency" / file)
    setup, contender = SimSetup(latency), Contender(DEFAULT_STRATEGY, max_batch_size=MAX_BATCH)
    m = mix()
    capacity = asyncio.run(measure_capacity(SimulatedDriver(setup), contender_maker(contender), Mix(steps=m.steps),
                                            2 * MAX_BATCH, 300.0 if costly else 60.0, 30.0, seed, progress=False))
    trace = arrivals(m, load * replicas * capacity.rps, duration, seed)
    load_s, out = 10 * latency.step_s(1), []
    for period in periods:
        fleet = Fleet(make_router("least_work", seed, load_s), latency, publish_every_s=period,
                      adapter_load_s=load_s, adapter_slots=ADAPTER_SLOTS)
        cores = [make_core(setup, contender, seed * 1000 + r) for r in range(replicas)]
        out.append(summarize(run_replicas(cores, trace, fleet), warmup_s=0.1 * duration).p95_s)
    return out


def plot(cells: list[dict], path: Path) -> None:
    """Each router's p95 over least_outstanding's, per cell, curves side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    short = {"gpu-1024-compute-bound": "GPU 1024\n(n costs n)", "gpu-512-sublinear": "GPU 512\nsublinear",
             "gpu-sd15-512": "GPU SD1.5\n512", "embedded-cpu": "embedded\nCPU"}
    labels = [f"{short.get(c['curve'], c['curve'])}\n{c['replicas']}x {c['load']:.0%}" for c in cells]
    routers = ["least_work", "power_of_two", "central"]
    fig, ax = plt.subplots(figsize=(max(8, 0.75 * len(cells)), 4.4))
    width = 0.8 / len(routers)
    for k, name in enumerate(routers):
        ys = []
        for c in cells:
            value = next(v for key, v in c["p95_s"].items() if key.startswith(name))
            ys.append(value / c["p95_s"]["least_outstanding"])
        ax.bar([i + (k - 1) * width for i in range(len(cells))], ys, width, label=name)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(cells)), labels, fontsize=6.5, rotation=0)
    ax.set_ylabel("p95 / least_outstanding's p95")
    ax.set_title("Simulated fleet: p95 by router (lower is better; 1 = least_outstanding)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
