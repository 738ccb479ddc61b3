"""Two models behind one simulated fleet: 8 replicas each holding both models (the device of each shared step by
step by the device policy, scheduling.device_share) against separate fleets, one per model, on the same seeded
trace.

The models: a compute-bound 1024x1024 DiT (gpu-1024-compute-bound: a batch of n costs about n steps of one) and an
SD 1.5-class UNet at 512x512 (gpu-sd15-512: batching pays), both at 20 steps, the default strategy (slo, each
engine predicting with its own curve), max batch 8. The trace: Poisson, each request for either model with
chance 1/2, at a fraction of the 8 replicas' capacity for that mix (capacity of one replica per model from the
simulated bench's closed loop; a replica serving the half-and-half mix does 1 / (0.5 / cap_a + 0.5 / cap_b)
requests per second). The first 10% of arrivals are served but not counted.

Fleets, each behind least_work: `shared 8` (8 replicas, both models on each); `split 4+4` (4 replicas per
model); `split by work` (the 8 replicas divided by each model's share of the offered device time, at least one
each). Printed: each model's p95 (a request that did not complete counts as infinitely late), and the
replica-seconds paid (replicas x the time until the last answer; the split fleets: both summed).

Switching a replica between models costs nothing here: both models stay resident and a step of either starts at
once (no weights move). A real shared replica needs memory for both, and pays a load when one was moved out.

    python benchmarks/models_fleet.py [--loads 0.6,0.85] [--duration 1200] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from pathlib import Path

from stepserve.bench.runner import measure_capacity
from stepserve.bench.targets import Contender
from stepserve.bench.workload import Mix
from stepserve.costs import FakeExecutor, LatencyModel
from stepserve.engine.config import EngineOptions
from stepserve.fleet.routers import make_router
from stepserve.request.types import SamplingParams
from stepserve.scheduling import DEFAULT_STRATEGY
from stepserve.scheduling.device_share import DeviceShare
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker
from stepserve.sim.device import Models
from stepserve.sim.loop import Arrival
from stepserve.sim.replicas import run_replicas, summarize

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"dit-1024": "gpu-1024-compute-bound", "sd15-512": "gpu-sd15-512"}
STEPS, MAX_BATCH, REPLICAS = 20, 8, 8


def curve(name: str) -> LatencyModel:
    return LatencyModel.load(ROOT / "stepserve/models/latency" / f"{MODELS[name]}.json")


def engine(latency: LatencyModel, seed: int):
    options = EngineOptions(strategy=DEFAULT_STRATEGY, max_batch_size=MAX_BATCH, latency_model=latency)
    return options.make_core(FakeExecutor.charging(latency, 0.0, seed))


def capacity_rps(latency: LatencyModel, seed: int) -> float:
    """One replica's saturated throughput for this model alone (the simulated bench's closed loop)."""
    contender = Contender(DEFAULT_STRATEGY, max_batch_size=MAX_BATCH)
    return asyncio.run(measure_capacity(SimulatedDriver(SimSetup(latency)), contender_maker(contender),
                                        Mix.from_steps([STEPS]), 2 * MAX_BATCH, 300.0, 30.0, seed,
                                        progress=False)).rps


def arrivals(rate: float, duration_s: float, seed: int) -> list[Arrival]:
    rng, t, out, names = random.Random(f"models-fleet-{seed}"), 0.0, [], list(MODELS)
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        out.append(Arrival(t, SamplingParams(prompt="a", seed=len(out), num_inference_steps=STEPS),
                           model=names[rng.random() >= 0.5]))


def run(label: str, fleets: list[tuple[list, list[Arrival]]], seed: int, warmup_s: float) -> dict:
    """Each (replicas, the arrivals they serve) behind its own least_work router; p95 per model, replica-s."""
    out, t0 = {"fleet": label, "p95_s": {}, "replica_s": 0.0, "completed": 0, "offered": 0}, time.perf_counter()
    for replicas, trace in fleets:
        result = run_replicas(replicas, trace, make_router("least_work", seed))
        out["replica_s"] += result.replica_s
        for name in MODELS:
            mine = [i for i, a in enumerate(trace) if a.model == name]
            if not mine:
                continue
            sub = type(result)([result.outcomes[i] for i in mine], result.end_time)
            s = summarize(sub, warmup_s=warmup_s)
            out["p95_s"][name] = s.p95_s
            out["completed"] += s.completed
            out["offered"] += s.offered
    out["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loads", default="0.6,0.85")
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    lat = {name: curve(name) for name in MODELS}
    cap = {name: capacity_rps(lat[name], args.seed) for name in MODELS}
    mixed = 1.0 / sum(0.5 / c for c in cap.values())  # one replica, the half-and-half mix
    work = {name: 0.5 / cap[name] for name in MODELS}  # device seconds per request of the mix, by model
    by_work = {name: max(1, round(REPLICAS * w / sum(work.values()))) for name, w in work.items()}
    while sum(by_work.values()) > REPLICAS:
        by_work[max(by_work, key=by_work.get)] -= 1
    print("capacity of one replica: " + ", ".join(f"{n} {c:.3f} req/s" for n, c in cap.items())
          + f"; the mix {mixed:.3f} req/s; split by work: "
          + " + ".join(f"{k} {n}" for n, k in by_work.items()), flush=True)
    print(f"{'load':>5} {'fleet':<16} " + " ".join(f"{'p95 ' + n:>14}" for n in MODELS)
          + f" {'replica-s':>10} {'done':>11}", flush=True)
    for load in [float(x) for x in args.loads.split(",")]:
        trace = arrivals(load * REPLICAS * mixed, args.duration, args.seed)
        warmup = 0.1 * args.duration
        only = {name: [a for a in trace if a.model == name] for name in MODELS}

        def split(counts: dict[str, int]) -> list:
            return [([engine(lat[n], args.seed * 1000 + r) for r in range(k)], only[n]) for n, k in counts.items()]

        shared = [Models({n: engine(lat[n], args.seed * 1000 + r) for n in MODELS}, DeviceShare())
                  for r in range(REPLICAS)]
        rows = [run(f"shared {REPLICAS}", [(shared, trace)], args.seed, warmup),
                run(f"split {REPLICAS // 2}+{REPLICAS // 2}", split(dict.fromkeys(MODELS, REPLICAS // 2)),
                    args.seed, warmup),
                run("split by work " + "+".join(str(k) for k in by_work.values()), split(by_work), args.seed,
                    warmup)]
        for row in rows:
            p95 = " ".join(f"{_s(row['p95_s'][n]):>14}" for n in MODELS)
            print(f"{load:>5.2f} {row['fleet']:<16} {p95} {row['replica_s']:>10.0f} "
                  f"{row['completed']:>5}/{row['offered']:<5} [{row['wall_s']:.0f} s]", flush=True)


def _s(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
