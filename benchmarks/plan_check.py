"""Does `stepserve plan` hold up live? The highest rate at which plan says one replica holds the SLO is found by
bisection in simulation; then a live in-process `stepserve bench` runs one engine at that rate (it should hold
the SLO) and at 1.3x that rate (it should miss it).

    python benchmarks/plan_check.py --out bench-out/plan-check --slo-p95-ms 400 --strategy continuous

Uses a fresh `stepserve profile` of the model (or --latency-model FILE). The p95 compared counts every request
(refused and unfinished ones as infinitely late), in simulation and live alike.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import add_run_args, stepserve


def one_replica_rate(latency_path: Path, args) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate (req/s) at which one simulated replica holds the SLO, by bisection."""
    from stepserve.bench.workload import Mix
    from stepserve.costs import LatencyModel
    from stepserve.sim.plan import PlanSpec, simulate_fleet

    latency = LatencyModel.load(latency_path)
    mix = Mix.from_steps([int(s) for s in args.steps.split(",")])
    tried = []

    def p95(rate: float) -> float:
        spec = PlanSpec(latency, rate, args.slo_p95_ms / 1000, mix, strategies=[args.strategy],
                        duration_s=args.sim_duration, seed=args.seed, max_batch_size=args.max_batch_size)
        _, probe = simulate_fleet(spec, args.strategy, 1, stop_early=False)
        tried.append((rate, probe.p95_s))
        return probe.p95_s

    lo, hi = 0.5, 1.0
    while p95(hi) <= args.slo_p95_ms / 1000:
        lo, hi = hi, hi * 2
    for _ in range(8):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p95(mid) <= args.slo_p95_ms / 1000 else (lo, mid)
    return lo, tried


def live_p95(rate: float, out: Path, args) -> dict:
    stepserve("bench", "--model", args.model, "--strategies", args.strategy, "--rate", f"{rate:.4f}",
              "--steps", args.steps, "--duration", str(args.duration), "--warmup", str(args.warmup),
              "--seed", str(args.seed), "--threads", str(args.threads), "--max-batch-size", str(args.max_batch_size),
              "--slo-p95-ms", str(args.slo_p95_ms), "--out", str(out), "--no-progress")
    run = json.loads((out / "results.json").read_text())["runs"][0]
    return {"rate_rps": rate, "p95_all_s": run["p95_all_s"], "p50_s": (run["latency"] or {}).get("p50"),
            "completed": run["counts"]["completed"], "offered": run["counts"].get("offered")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/plan-check", duration_s=40.0)  # --duration: live measured seconds per rate
    p.add_argument("--latency-model", type=Path)
    p.add_argument("--strategy", default="continuous")
    p.add_argument("--slo-p95-ms", type=float, default=400.0)
    p.add_argument("--sim-duration", type=float, default=300.0, help="simulated seconds per probed rate")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    latency = args.latency_model or args.out / "latency.json"
    if args.latency_model is None:
        stepserve("profile", "--model", args.model, "--threads", str(args.threads), "--max-batch-size",
                  str(2 * args.max_batch_size), "--out", str(latency))
    rate, tried = one_replica_rate(latency, args)
    print(f"plan: one replica of {args.strategy} holds p95 <= {args.slo_p95_ms:g} ms up to {rate:.2f} req/s "
          f"(simulated; {len(tried)} rates probed)", flush=True)
    at = live_p95(rate, args.out / "live-at", args)
    above = live_p95(1.3 * rate, args.out / "live-1.3x", args)
    slo = args.slo_p95_ms / 1000
    for name, r in (("at the planned rate", at), ("at 1.3x the planned rate", above)):
        verdict = "holds" if r["p95_all_s"] is not None and r["p95_all_s"] <= slo else "misses"
        p95 = "inf" if r["p95_all_s"] is None else f"{r['p95_all_s'] * 1000:.0f} ms"
        print(f"live {name}: {r['rate_rps']:.2f} req/s, p95 (all requests) {p95} -> {verdict} the SLO")
    print(json.dumps({"planned_rate_rps": rate, "slo_ms": args.slo_p95_ms, "live_at": at, "live_1_3x": above,
                      "probed": tried}))


if __name__ == "__main__":
    main()
