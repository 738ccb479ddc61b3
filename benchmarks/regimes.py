"""The regime matrix on a simulated clock: every contender in every cost regime, at 0.3, 0.7 and 0.9 of capacity,
without deadlines and then with per-request deadlines of 3x the request's own standalone latency.

Regimes are latency models shipped in stepserve/models/latency/: the embedded model on this CPU (cheap batching)
and three GPU curves written from published figures (benchmarks/gpu_latency_models.py). Every run is the bench's
own code on simulated engines (stepserve.sim.bench: the real EngineCore and policies, charged by the model), so
a cell here is a `stepserve simulate --load trace` run; this script only builds the traces and reads the results.

- Standalone latency: the bench's idle latency of a lone request at each step count (the mix varies only steps).
- Capacity: each contender's saturated throughput (the bench's closed-loop measurement, 2x batch users); loads
  are fractions of the best of them. The same Poisson trace (per regime and load) goes to every contender.
- Deadlines: each trace row carries timeout_s = 3x its own standalone latency (the trace format's timeout_s).
- Metrics: p50/p95/p99 latency of completed requests (the bench's); p95 slowdown = latency / standalone latency
  (completed requests); attainment = measured requests completed within 3x their standalone latency, unfinished
  and refused ones counted as misses, in every cell (with or without deadlines); goodput = those completions
  inside the measured window, per second; done = completed / measured.

    python benchmarks/regimes.py [--regimes cpu-embedded,gpu-1024] [--contenders default,none,slo]
                                 [--requests 200] [--min-duration 60] [--json regimes.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from stepserve.bench.app import BenchConfig, run_bench
from stepserve.bench.metrics import percentile
from stepserve.bench.runner import measure_capacity, measure_idle
from stepserve.bench.targets import Contender
from stepserve.bench.workload import Mix, Trace, TraceItem, poisson_trace, save_trace
from stepserve.engine_config import EngineOptions
from stepserve.sim.bench import SimulatedDriver, contender_maker, load_setup, simulated_testbed

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "stepserve" / "models" / "latency"
REGIMES = {  # name: (latency model file, step counts of the mix)
    "cpu-embedded": ("embedded-cpu.json", (8, 20, 40)),
    "gpu-512": ("gpu-512-sublinear.json", (20, 28, 50)),
    "gpu-sd15": ("gpu-sd15-512.json", (20, 28, 50)),
    "gpu-1024": ("gpu-1024-compute-bound.json", (20, 28, 50)),
}
# "default" is whatever EngineOptions defaults to; a new strategy joins the matrix by adding its name here.
CONTENDERS = ("default", "none", "static", "dynamic:10", "dynamic:50", "continuous", "slo")
LOADS = (0.3, 0.7, 0.9)
DEADLINE_X = 3.0


def contender(spec: str, batch: int) -> Contender:
    """'name' or 'dynamic:DELAY_MS'; 'default' is the engine's default strategy."""
    name, _, delay = spec.partition(":")
    name = EngineOptions().strategy if name == "default" else name
    extra = {"max_queue_delay_ms": float(delay)} if delay else {}
    return Contender(name, max_batch_size=batch, **extra)


class RecordingDriver(SimulatedDriver):
    """The bench's simulated driver, keeping each contender's load result (the outcomes, for per-request metrics)."""

    def __init__(self, setup) -> None:
        super().__init__(setup)
        self.results = {}

    async def run(self, maker, plan, seed, done):
        ran = await super().run(maker, plan, seed, done)
        self.results[maker.name] = ran.result
        return ran


async def calibrate(setup, mix: Mix, contenders: list[Contender], batch: int, seed: int):
    """Standalone latency per step count, and each contender's saturated capacity (req/s)."""
    driver = SimulatedDriver(setup)
    reference = contender_maker(Contender("continuous", max_batch_size=batch))
    idle = await measure_idle(driver, reference, mix, progress=False, seed=seed)
    longest = max(i.latency_s for i in idle)
    # a compute-bound full batch takes about `batch` lone requests: the window must hold several of them
    duration, warmup = max(60.0, 5.0 * longest * batch), 2.0 * longest * batch
    capacity = {}
    for c in contenders:
        cap = await measure_capacity(driver, contender_maker(c), mix, 2 * batch, duration, warmup, seed, False)
        capacity[c.name] = cap.rps
    return {i.steps: i.latency_s for i in idle}, capacity


def cell_metrics(result, standalone: dict[int, float], summary) -> dict:
    measured = result.measured
    done = [o for o in measured if o.latency_s is not None]
    slow = [o.latency_s / standalone[o.spec.num_inference_steps] for o in done]
    good = [o for o in done if o.latency_s <= DEADLINE_X * standalone[o.spec.num_inference_steps]]
    lo, hi = result.window_start_s, result.window_end_s
    in_window = sum(1 for o in good if lo <= o.done_s <= hi)
    return {"p50_s": summary.p50_s.median, "p95_s": summary.p95_s.median, "p99_s": summary.p99_s.median,
            "slowdown_p95": percentile(slow, 95) if slow else None,
            "attainment": len(good) / len(measured) if measured else None,
            "goodput_rps": in_window / (hi - lo) if hi > lo else None,
            "done": len(done) / len(measured) if measured else None, "measured": len(measured)}


def run_cell(setup, mix, contenders, trace: Trace, warmup_s: float, seed: int, folder: Path,
             standalone: dict[int, float]) -> dict[str, dict]:
    path = folder / "trace.jsonl"
    save_trace(trace, path)
    cfg = BenchConfig(argv=["regimes"], mix=mix, out=folder, contenders=contenders, load="trace",
                      trace_file=str(path), warmup_s=warmup_s, duration_s=trace.duration_s, seed=seed,
                      progress=False)
    bed = simulated_testbed(cfg, setup)
    bed.driver = RecordingDriver(setup)
    run = asyncio.run(run_bench(cfg, bed))
    summaries = {s.contender: s for s in run.results.summaries}
    return {name: cell_metrics(result, standalone, summaries[name]) for name, result in bed.driver.results.items()}


def run_regime(name: str, specs: list[str], args) -> list[dict]:
    file, steps = REGIMES[name]
    setup = load_setup(MODELS / file)
    mix = Mix.from_steps(list(args.steps or steps))
    labels = {s: contender(s, args.max_batch_size) for s in specs}
    if "default" in labels:  # the contender the default resolves to is reported once, as the default
        labels = {s: c for s, c in labels.items() if s == "default" or c != labels["default"]}
    distinct = list({c.name: c for c in labels.values()}.values())
    standalone, capacity = asyncio.run(calibrate(setup, mix, distinct, args.max_batch_size, args.seed))
    best = max(capacity, key=capacity.get)
    rows = []
    for frac in args.loads:
        rate = frac * capacity[best]
        duration = max(args.min_duration, args.requests / rate)
        warmup = 0.1 * duration
        base = poisson_trace(mix, rate, warmup + duration, args.seed)
        for deadline in (False, True):
            items = base.items if not deadline else [
                TraceItem(it.offset_s, replace(it.spec, timeout_s=DEADLINE_X * standalone[it.spec.num_inference_steps]))
                for it in base.items]
            with tempfile.TemporaryDirectory() as tmp:
                cells = run_cell(setup, mix, distinct, Trace(items, base.description), warmup, args.seed,
                                 Path(tmp), standalone)
            for spec, c in labels.items():
                label = f"default={c.name}" if spec == "default" else c.name
                rows.append({"regime": name, "load": frac, "deadline": f"{DEADLINE_X:g}x" if deadline else "none",
                             "contender": label, "rate_rps": rate, "duration_s": duration, **cells[c.name]})
        print(f"  {name} load {frac:g}: {rate:.3g} req/s, {duration:.0f} s simulated", file=sys.stderr)
    meta = {"regime": name, "latency_model": file, "steps": list(mix.steps.values),
            "standalone_s": {str(k): v for k, v in standalone.items()}, "capacity_rps": capacity,
            "best_capacity": best}
    return [{"meta": meta}] + rows


def fmt(v, kind: str) -> str:
    if v is None or (isinstance(v, float) and math.isinf(v)):
        return "-"
    return {"s": f"{v:.2f}", "x": f"{v:.2f}x", "%": f"{100 * v:.0f}%", "r": f"{v:.3g}"}[kind]


def table(rows: list[dict]) -> str:
    head = "| regime | load | deadline | contender | p50 s | p95 s | p99 s | p95 slowdown | attainment | goodput/s | done |"
    out = [head, "|" + "---|" * 11]
    for r in rows:
        out.append(f"| {r['regime']} | {r['load']:g} | {r['deadline']} | {r['contender']} | {fmt(r['p50_s'], 's')} "
                   f"| {fmt(r['p95_s'], 's')} | {fmt(r['p99_s'], 's')} | {fmt(r['slowdown_p95'], 'x')} "
                   f"| {fmt(r['attainment'], '%')} | {fmt(r['goodput_rps'], 'r')} | {fmt(r['done'], '%')} |")
    return "\n".join(out)


def gaps(rows: list[dict]) -> str:
    """Per cell: the default's p95 and attainment against the best contender's."""
    out = ["| regime | load | deadline | default p95 / best p95 (best) | best attainment - default's (best) |",
           "|---|---|---|---|---|"]
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["regime"], r["load"], r["deadline"]), []).append(r)
    for key, rs in cells.items():
        d = next((r for r in rs if r["contender"].startswith("default")), None)
        top = max(r["done"] or 0 for r in rs)  # p95 covers completions: compare those that completed as many
        ok = [r for r in rs if r["p95_s"] is not None and (r["done"] or 0) >= top - 0.01]
        if d is None or not ok:
            continue
        bp = min(ok, key=lambda r: r["p95_s"])
        ba = max(rs, key=lambda r: r["attainment"] or 0)
        ratio = fmt(d["p95_s"] / bp["p95_s"], "x") if d["p95_s"] else "-"
        out.append(f"| {key[0]} | {key[1]:g} | {key[2]} | {ratio} ({bp['contender']}) "
                   f"| {100 * ((ba['attainment'] or 0) - (d['attainment'] or 0)):.0f} pts ({ba['contender']}) |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated: {', '.join(REGIMES)}")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="names; dynamic:MS for a dynamic delay")
    p.add_argument("--loads", default=",".join(map(str, LOADS)), help="fractions of the best capacity")
    p.add_argument("--steps", help="override every regime's step counts, e.g. 8,20")
    p.add_argument("--requests", type=int, default=200, help="about this many requests per run (sets the duration)")
    p.add_argument("--min-duration", type=float, default=60.0, help="simulated seconds per run at least")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("regimes.json"))
    args = p.parse_args(argv)
    args.loads = [float(x) for x in args.loads.split(",")]
    args.steps = [int(x) for x in args.steps.split(",")] if args.steps else None
    specs = [s.strip() for s in args.contenders.split(",") if s.strip()]
    t0 = time.monotonic()
    rows, metas = [], []
    for name in args.regimes.split(","):
        out = run_regime(name.strip(), specs, args)
        metas.append(out[0]["meta"])
        rows += out[1:]
    wall = time.monotonic() - t0
    print(table(rows))
    print()
    print(gaps(rows))
    print(f"\nwall time {wall:.1f} s")
    args.json.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv, "wall_s": wall,
                                     "deadline_x_standalone": DEADLINE_X, "regimes": metas, "rows": rows},
                                    indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
