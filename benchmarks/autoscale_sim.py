"""Autoscaling on the SLO against Ray Serve's default policy, simulated: one trace whose rate steps from 0.3 to
1.2 to 0.3 of 8 replicas' capacity, replicas that take `--startup-s` to start, the default strategy on every
replica, least_work routing; Ray's default policy at three target_ongoing_requests values.

For each policy: SLO attainment (requests answered within the SLO, over all of them), p95, replica-seconds paid
(starting replicas included) and the most replicas run; then the replica count over time as a plot. The SLO is
2 x the idle latency of the longest request of the mix (the bench's default rule).

    python benchmarks/autoscale_sim.py [--latency-model stepserve/models/latency/gpu-1024-compute-bound.json]
        [--phase-s 300] [--startup-s 30] [--targets 1,2,4] [--max-replicas 12] [--out autoscale-out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from stepserve.bench.runner import measure_capacity
from stepserve.bench.targets import Contender
from stepserve.bench.workload import Mix, Trace, TraceItem, poisson_trace
from stepserve.costs import LatencyModel
from stepserve.fleet.autoscale import SLOScaling
from stepserve.fleet.routers import make_router
from stepserve.scheduling import DEFAULT_STRATEGY
from stepserve.sim.autoscale import Autoscaler, RayDefault
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker, make_core
from stepserve.sim.fleet import Fleet
from stepserve.sim.loop import Arrival
from stepserve.sim.replicas import run_replicas, summarize

ROOT = Path(__file__).resolve().parent.parent


def step_trace(mix: Mix, rates: list[float], phase_s: float, seed: int) -> Trace:
    """Poisson arrivals at each rate in turn, phase_s seconds each."""
    items = []
    for k, rate in enumerate(rates):
        items += [TraceItem(k * phase_s + it.offset_s, it.spec)
                  for it in poisson_trace(mix, rate, phase_s, seed * 100 + k).items]
    return Trace(items, f"Poisson steps of {phase_s:g} s at {', '.join(f'{r:.3g}' for r in rates)} req/s")


def step_arrivals(mix: Mix, rates: list[float], phase_s: float, seed: int) -> list[Arrival]:
    return [Arrival(it.offset_s, it.spec.to_params()) for it in step_trace(mix, rates, phase_s, seed).items]


def run_one(setup: SimSetup, contender: Contender, arrivals, policy, startup_s: float, start: int, slo_s: float,
            publish_every_s: float = 0.0):
    cores = [make_core(setup, contender, r) for r in range(start)]
    scaler = Autoscaler(policy, lambda r: make_core(setup, contender, r), startup_s)
    fleet = Fleet(make_router("least_work"), setup.latency, publish_every_s=publish_every_s, autoscaler=scaler)
    t0 = time.perf_counter()
    result = run_replicas(cores, arrivals, fleet)
    s = summarize(result, slo_s)
    return {"attainment": s.goodput_frac, "p95_s": s.p95_s, "replica_s": round(result.replica_s, 1),
            "most_replicas": max(n for _, n in result.replicas), "replicas": result.replicas,
            "completed": s.completed, "offered": s.offered, "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency-model", default=str(ROOT / "stepserve/models/latency/gpu-1024-compute-bound.json"))
    p.add_argument("--steps", default="4,20,50")
    p.add_argument("--phase-s", type=float, default=300.0)
    p.add_argument("--fracs", default="0.3,1.2,0.3", help="each phase's rate, as a fraction of 8 replicas' capacity")
    p.add_argument("--startup-s", type=float, default=30.0)
    p.add_argument("--targets", default="1,2,4", help="Ray's target_ongoing_requests values to try")
    p.add_argument("--utilisations", default="0.8", help="the SLO policy's target utilisation(s) to try")
    p.add_argument("--max-replicas", type=int, default=12)
    p.add_argument("--start", type=int, default=3, help="replicas running at the start (every policy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("autoscale-out"))
    args = p.parse_args()

    latency = LatencyModel.load(args.latency_model)
    setup = SimSetup(latency)
    mix = Mix.from_steps([int(s) for s in args.steps.split(",")])
    contender = Contender(DEFAULT_STRATEGY, max_batch_size=8)
    driver = SimulatedDriver(setup)
    capacity = asyncio.run(measure_capacity(driver, contender_maker(contender), mix, 16, 600.0, 60.0, args.seed,
                                            progress=False)).rps
    idle = asyncio.run(driver.lone(contender_maker(contender), [mix.heaviest(max(mix.steps.values))], 0,
                                   lambda: None))[0][1]
    slo_s = 2.0 * idle
    rates = [float(f) * 8 * capacity for f in args.fracs.split(",")]
    arrivals = step_arrivals(mix, rates, args.phase_s, args.seed)
    print(f"{Path(args.latency_model).name}: capacity {capacity:.3f} req/s per replica; SLO p95 {slo_s:.2f} s "
          f"(2 x idle of {max(mix.steps.values)} steps); rates {', '.join(f'{r:.2f}' for r in rates)} req/s, "
          f"{args.phase_s:g} s each; start-up {args.startup_s:g} s; {len(arrivals)} requests", flush=True)
    rows = {}
    for u in [float(x) for x in args.utilisations.split(",")]:
        rule = SLOScaling(slo_s, 1, args.max_replicas, args.startup_s, utilisation=u)
        rows[f"slo {u:g}"] = run_one(setup, contender, arrivals, rule, args.startup_s, args.start, slo_s)
    for target in [float(t) for t in args.targets.split(",")]:
        rows[f"ray target {target:g}"] = run_one(setup, contender, arrivals,
                                                 RayDefault(target, 1, args.max_replicas), args.startup_s,
                                                 args.start, slo_s)
    print(f"{'policy':<16} {'attainment':>10} {'p95 (s)':>8} {'replica-s':>10} {'most':>5}")
    for name, r in rows.items():
        print(f"{name:<16} {r['attainment']:>10.3f} {r['p95_s']:>8.2f} {r['replica_s']:>10.0f} "
              f"{r['most_replicas']:>5}  [{r['wall_s']} s]", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "autoscale.json").write_text(json.dumps({
        "latency_model": Path(args.latency_model).name, "capacity_rps": capacity, "slo_s": slo_s, "rates": rates,
        "phase_s": args.phase_s, "startup_s": args.startup_s, "rows": rows}, indent=1, default=str) + "\n")
    plot(rows, args.phase_s, len(rates), args.out / "replicas_over_time.png")
    print(f"wrote {args.out / 'autoscale.json'} and {args.out / 'replicas_over_time.png'}")


def plot(rows: dict, phase_s: float, phases: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, r in rows.items():
        pts = r["replicas"]
        xs, ys = [], []
        for t, n in pts:
            if xs:
                xs.append(t)
                ys.append(ys[-1])
            xs.append(t)
            ys.append(n)
        xs.append(phases * phase_s)
        ys.append(ys[-1])
        ax.plot(xs, ys, label=f"{name} (attainment {r['attainment']:.2f}, {r['replica_s']:.0f} replica-s)")
    for k in range(1, phases):
        ax.axvline(k * phase_s, color="grey", lw=0.5, ls=":")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("replicas paid for")
    ax.set_title("Replicas over time: a load step 0.3 -> 1.2 -> 0.3 of 8 replicas (simulated)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
