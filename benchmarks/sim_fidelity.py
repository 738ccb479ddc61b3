"""How close `stepserve simulate` comes to a live in-process `stepserve bench` on the same trace.

1. `stepserve profile` measures the model on this machine right before each load's live run (or --latency-model
   gives one file for all), so the machine's drift between the profile and the live run stays small.
2. For each load (--fracs of continuous batching's capacity): a live `stepserve bench` in process with every
   contender writes its trace; `stepserve simulate` replays that very trace with the latency model, the same
   contenders and the same SLO.
3. Calibrated (--calibrate, the default): the profile is a prior, corrected by the run itself, as the engine's
   online cost model corrects its curve: for each contender, the time its live steps took over the time the
   profile predicts for those steps (their batch sizes) scales the whole profile, and that contender's run is
   simulated again on its own scaled profile (a ratio of totals: queueing follows the busy time). This separates the simulator's model of the engine (queueing,
   batching, scheduling) from the machine's speed drifting between the profile and the run.
4. Capacity: the live bench measures continuous batching's saturated throughput (a closed loop) before its runs;
   `stepserve simulate` measures the same on the latency model (the target is within 10%).
5. Tables: live and simulated p50 / p95 per contender and load, and their ratios (the target is within 15%).

    .venv/bin/python benchmarks/sim_fidelity.py --out bench-out/fidelity --fracs 0.6,0.8 --duration 30

A parallel degree (--engine-flags "--ulysses-degree 2") is given to the profile and to the live bench alike: the
profile then says its degree, and the simulator's engine steps with the degree-2 curve.
"""

from __future__ import annotations

import argparse
import json
import shlex
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
    p.add_argument("--engine-flags", default="", help="more flags for the profile and the live bench alike, e.g. "
                                                       "\"--ulysses-degree 2\"")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="simulate on the profile alone (no correction from the run's own step times)")
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
                      args.profile_statistic, "--out", str(latency), *shlex.split(args.engine_flags))
        live = args.out / f"live-{frac}"
        stepserve("bench", "--model", args.model, "--threads", str(args.threads), "--rate-frac", frac,
                  "--duration", str(args.duration), "--warmup", str(args.warmup), "--out", str(live), *common,
                  *shlex.split(args.engine_flags))
        live_results = json.loads((live / "results.json").read_text())
        slo_ms = live_results["slo_s"] * 1000
        capacities.append(_capacity_row(float(frac), live_results, latency, args))
        sim = args.out / f"sim-{frac}"
        stepserve("simulate", "--latency-model", str(latency), "--load", "trace", "--trace", str(live / "trace.jsonl"),
                  "--slo-p95-ms", f"{slo_ms:.3f}", "--duration", str(args.duration), "--warmup", str(args.warmup),
                  "--out", str(sim), *common)
        got, want = summaries(sim), summaries(live)
        calibrated = _calibrated_runs(args, frac, latency, live, live_results, slo_ms) if args.calibrate else {}
        for name in want:
            lv, sv, cv = want[name], got.get(name), calibrated.get(name)
            row = {"load": float(frac), "contender": name,
                   "calibration": cv[1] if cv else None}
            for key in ("p50_s", "p95_s"):
                a = (lv.get(key) or {}).get("median")
                b = ((sv or {}).get(key) or {}).get("median")
                c = ((cv[0] if cv else None) or {}).get(key, {}).get("median")
                row[f"live_{key}"], row[f"sim_{key}"], row[f"cal_{key}"] = a, b, c
                row[f"ratio_{key}"] = b / a if a and b else None
                row[f"cal_ratio_{key}"] = c / a if a and c else None
            rows.append(row)
    print(f"\n{'load':>5} {'contender':20} {'live p50':>9} {'sim p50':>9} {'sim/live':>8} {'live p95':>9} "
          f"{'sim p95':>9} {'sim/live':>8}")
    def ms(v):
        return f"{v * 1000:9.0f}" if v else f"{'-':>9}"

    def ratio(v):
        return f"{v:8.2f}" if v else f"{'-':>8}"

    for r in rows:
        print(f"{r['load']:5.2f} {r['contender']:20} {ms(r['live_p50_s'])} {ms(r['sim_p50_s'])} "
              f"{ratio(r['ratio_p50_s'])} {ms(r['live_p95_s'])} {ms(r['sim_p95_s'])} {ratio(r['ratio_p95_s'])}")
    within = [abs(r[k] - 1) <= 0.15 for r in rows for k in ("ratio_p50_s", "ratio_p95_s") if r[k]]
    print(f"within 15%: {sum(within)} of {len(within)} percentiles")
    if args.calibrate:
        print(f"\n{'load':>5} {'contender':20} {'scale':>6} {'live p50':>9} {'cal p50':>9} {'cal/live':>8} "
              f"{'live p95':>9} {'cal p95':>9} {'cal/live':>8}   (profile scaled by the run's own step times)")
        for r in rows:
            scale = f"{r['calibration']:6.2f}" if r["calibration"] else f"{'-':>6}"
            print(f"{r['load']:5.2f} {r['contender']:20} {scale} {ms(r['live_p50_s'])} {ms(r['cal_p50_s'])} "
                  f"{ratio(r['cal_ratio_p50_s'])} {ms(r['live_p95_s'])} {ms(r['cal_p95_s'])} "
                  f"{ratio(r['cal_ratio_p95_s'])}")
        within = [abs(r[k] - 1) <= 0.15 for r in rows for k in ("cal_ratio_p50_s", "cal_ratio_p95_s") if r[k]]
        print(f"calibrated, within 15%: {sum(within)} of {len(within)} percentiles")
    print(f"\n{'load':>5} {'live capacity':>14} {'sim capacity':>13} {'sim/live':>8}   (continuous, closed loop)")
    for c in capacities:
        print(f"{c['load']:5.2f} {c['live_rps']:10.2f} req/s {c['sim_rps']:8.2f} req/s {c['ratio']:8.2f}")
    print(f"capacity within 10%: {sum(abs(c['ratio'] - 1) <= 0.10 for c in capacities)} of {len(capacities)}")
    print(json.dumps({"percentiles": rows, "capacity": capacities}))


def _calibrated_runs(args, frac: str, latency: Path, live: Path, live_results: dict, slo_ms: float) -> dict:
    """contender -> (its summary simulated on the profile scaled by its own live steps, the scale)."""
    from stepserve.costs.latency_model import LatencyModel

    data = json.loads(Path(latency).read_text())
    model = LatencyModel.from_dict(data)
    out = {}
    for timeline in live_results["timelines"]:
        name = timeline["contender"]
        steps = [(b, d) for b, d in zip(timeline["batch_size"], timeline["duration_s"]) if b > 0]
        predicted = sum(model.step_s(b) for b, _ in steps)
        if not predicted:
            continue
        scale = sum(d for _, d in steps) / predicted
        scaled = args.out / f"latency-{frac}-{_slug(name)}.json"
        scaled.write_text(json.dumps(_scaled(data, scale)))
        strategy, delays = (name.split("(")[0], name.split("(")[1].rstrip("ms)")) if "(" in name else (name, "50")
        sim = args.out / f"sim-{frac}-{_slug(name)}"
        stepserve("simulate", "--latency-model", str(scaled), "--load", "trace", "--trace", str(live / "trace.jsonl"),
                  "--slo-p95-ms", f"{slo_ms:.3f}", "--duration", str(args.duration), "--warmup", str(args.warmup),
                  "--out", str(sim), "--strategies", strategy, "--dynamic-delays-ms", delays, "--steps", args.steps,
                  "--seed", str(args.seed), "--max-batch-size", str(args.max_batch_size), "--no-progress")
        out[name] = (summaries(sim).get(name), scale)
    return out


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


def _scaled(value, scale: float):
    """A latency model's JSON with every measured curve ("points" and "encode": [count, seconds]) times `scale`."""
    if isinstance(value, dict):
        return {k: ([[n, t * scale] for n, t in v] if k in ("points", "encode") else v if k == "spread"
                    else _scaled(v, scale)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scaled(v, scale) for v in value]
    return value


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
