"""How close `stepserve simulate` comes to a live in-process `stepserve bench` on the same trace.

1. `stepserve profile` measures the model on this machine right before each load's live run (or --latency-model
   gives one file for all), so the machine's drift between the profile and the live run stays small.
2. For each load (--fracs of continuous batching's capacity): a live `stepserve bench` in process with every
   contender writes its trace; `stepserve simulate` replays that very trace with the latency model, the same
   contenders and the same SLO.
3. Capacity: the live bench measures continuous batching's saturated throughput (a closed loop) before its runs;
   `stepserve simulate` measures the same on the latency model (the target is within 10%).
4. A table: live and simulated p50 / p95 per contender and load, and their ratios (the target is within 15%).

    .venv/bin/python benchmarks/sim_fidelity.py --out bench-out/fidelity --fracs 0.6,0.8 --duration 30
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import add_run_args, stepserve, summaries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/fidelity")
    p.add_argument("--latency-model", type=Path, help="skip profiling and use this file")
    p.add_argument("--strategies", default="slo,continuous,dynamic,static,none")
    p.add_argument("--dynamic-delays-ms", default="50")
    p.add_argument("--fracs", default="0.6,0.8")
    p.add_argument("--profile-rounds", type=int, default=10, help="`stepserve profile --rounds` (default 10)")
    p.add_argument("--profile-statistic", choices=("mean", "median"), default="mean")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    common = ["--strategies", args.strategies, "--dynamic-delays-ms", args.dynamic_delays_ms, "--steps", args.steps,
              "--seed", str(args.seed), "--max-batch-size", str(args.max_batch_size), "--no-progress"]
    rows, capacities = [], []
    for frac in args.fracs.split(","):
        latency = args.latency_model or args.out / f"latency-{frac}.json"
        if args.latency_model is None:
            stepserve("profile", "--model", args.model, "--threads", str(args.threads), "--max-batch-size",
                      str(2 * args.max_batch_size), "--rounds", str(args.profile_rounds), "--statistic",
                      args.profile_statistic, "--out", str(latency))
        live = args.out / f"live-{frac}"
        stepserve("bench", "--model", args.model, "--threads", str(args.threads), "--rate-frac", frac,
                  "--duration", str(args.duration), "--warmup", str(args.warmup), "--out", str(live), *common)
        live_results = json.loads((live / "results.json").read_text())
        slo_ms = live_results["slo_s"] * 1000
        capacities.append(_capacity_row(float(frac), live_results, latency, args))
        sim = args.out / f"sim-{frac}"
        stepserve("simulate", "--latency-model", str(latency), "--load", "trace", "--trace", str(live / "trace.jsonl"),
                  "--slo-p95-ms", f"{slo_ms:.3f}", "--duration", str(args.duration), "--warmup", str(args.warmup),
                  "--out", str(sim), *common)
        got, want = summaries(sim), summaries(live)
        for name in want:
            lv, sv = want[name], got.get(name)
            row = {"load": float(frac), "contender": name}
            for key in ("p50_s", "p95_s"):
                a = (lv.get(key) or {}).get("median")
                b = ((sv or {}).get(key) or {}).get("median")
                row[f"live_{key}"], row[f"sim_{key}"] = a, b
                row[f"ratio_{key}"] = b / a if a and b else None
            rows.append(row)
    print(f"\n{'load':>5} {'contender':20} {'live p50':>9} {'sim p50':>9} {'sim/live':>8} {'live p95':>9} "
          f"{'sim p95':>9} {'sim/live':>8}")
    for r in rows:
        def ms(v):
            return f"{v * 1000:9.0f}" if v else f"{'-':>9}"

        def ratio(v):
            return f"{v:8.2f}" if v else f"{'-':>8}"

        print(f"{r['load']:5.2f} {r['contender']:20} {ms(r['live_p50_s'])} {ms(r['sim_p50_s'])} "
              f"{ratio(r['ratio_p50_s'])} {ms(r['live_p95_s'])} {ms(r['sim_p95_s'])} {ratio(r['ratio_p95_s'])}")
    within = [abs(r[k] - 1) <= 0.15 for r in rows for k in ("ratio_p50_s", "ratio_p95_s") if r[k]]
    print(f"within 15%: {sum(within)} of {len(within)} percentiles")
    print(f"\n{'load':>5} {'live capacity':>14} {'sim capacity':>13} {'sim/live':>8}   (continuous, closed loop)")
    for c in capacities:
        print(f"{c['load']:5.2f} {c['live_rps']:10.2f} req/s {c['sim_rps']:8.2f} req/s {c['ratio']:8.2f}")
    print(f"capacity within 10%: {sum(abs(c['ratio'] - 1) <= 0.10 for c in capacities)} of {len(capacities)}")
    print(json.dumps({"percentiles": rows, "capacity": capacities}))


def _capacity_row(frac: float, live_results: dict, latency: Path, args: argparse.Namespace) -> dict:
    """The live run's measured capacity against the simulator's, measured the same way on the latency model."""
    out = args.out / f"sim-capacity-{frac}"
    stepserve("simulate", "--latency-model", str(latency), "--strategies", "continuous", "--steps", args.steps,
              "--seed", str(args.seed), "--max-batch-size", str(args.max_batch_size), "--rate-frac", "0.5",
              "--duration", "2", "--warmup", "1", "--out", str(out), "--no-progress")
    live_rps = live_results["capacity"]["rps"]
    sim_rps = json.loads((out / "results.json").read_text())["capacity"]["rps"]
    return {"load": frac, "live_rps": live_rps, "sim_rps": sim_rps, "ratio": sim_rps / live_rps}


if __name__ == "__main__":
    main()
