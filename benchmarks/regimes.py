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
  inside the measured window, per second; done = completed / measured; refused and timed out = the measured
  requests refused at admission and those ended by a timeout (given up as hopeless or past their deadline);
  batch_seen (JSON only) = the mean size of the forwards the completed requests' steps ran in; queue_mean_s,
  first_step_mean_s, denoise_mean_s, decode_mean_s (JSON only) = the completed requests' mean wait for a slot,
  arrival to first step done, time in a slot denoising (paused steps included) and decode.

    python benchmarks/regimes.py [--regimes cpu-embedded,gpu-1024] [--contenders default,none,slo]
                                 [--requests 200] [--min-duration 60] [--json regimes.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from stepserve.bench.app import run_bench
from stepserve.bench.config import BenchConfig
from stepserve.bench.live_bed import live_testbed
from stepserve.bench.runner import measure_capacity, measure_idle
from stepserve.bench.targets import OK, Contender
from stepserve.bench.trace_files import save_trace
from stepserve.bench.workload import Mix, Trace, TraceItem, poisson_trace
from stepserve.engine.config import EngineOptions
from stepserve.sim.bench import load_setup, simulated_testbed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from regimes_report import (DEADLINE_X, batch_seen, cell_metrics, controls, median_metrics, standings,  # noqa: E402
                            step_rate, table, verdict)

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "stepserve" / "models" / "latency"
REGIMES = {  # name: (latency model file, step counts of the mix)
    "cpu-embedded": ("embedded-cpu.json", (8, 20, 40)),
    "gpu-512": ("gpu-512-sublinear.json", (20, 28, 50)),
    "gpu-sd15": ("gpu-sd15-512.json", (20, 28, 50)),
    "gpu-1024": ("gpu-1024-compute-bound.json", (20, 28, 50)),
    "cpu-tinyflux": ("tinyflux-cpu.json", (4, 10, 20)),  # the live tiny Flux's curve, profiled on this CPU
}
# "default" is whatever EngineOptions defaults to; a new strategy joins the matrix by adding its name here.
CONTENDERS = ("default", "none", "static", "dynamic:10", "dynamic:50", "continuous", "slo")
# Live on this machine: name: (model, step counts of the mix). The embedded model batches cheaply; the tiny Flux
# (random weights, built on first use) at its benchmark size costs about n forwards for a batch of n.
LIVE = {
    "live-embedded": ("embedded", (8, 20, 40)),
    "live-tinyflux": ("tinyflux", (4, 10, 20)),
}
LOADS = (0.3, 0.7, 0.9)


def contender(spec: str, batch: int) -> Contender:
    """'name', 'dynamic:DELAY_MS' or 'slo:ORDER'; 'default' is the engine's default strategy and settings. A
    suffix '#2' makes a second copy of a contender under its own label: a control (an A/A pair), which shows how
    far two runs of one strategy differ on this machine; it is left out of the verdict (regimes_report.controls)."""
    spec, hash_, copy = spec.partition("#")
    if hash_:
        original = contender(spec, batch)
        return replace(original, label=f"{original.name}#{copy}")
    name, _, setting = spec.partition(":")
    if name == "default":
        return Contender(EngineOptions().strategy, max_batch_size=batch)
    extra = {}
    if setting:
        extra = {"max_queue_delay_ms": float(setting)} if name == "dynamic" else {"slo_order": setting}
    return Contender(name, max_batch_size=batch, **extra)


class Recording:
    """A bench driver (either clock) that keeps every load result per contender (the outcomes, for per-request
    metrics), one per repeat."""

    def __init__(self, inner) -> None:
        self.inner, self.results = inner, {}

    async def run(self, maker, plan, seed, done):
        ran = await self.inner.run(maker, plan, seed, done)
        self.results.setdefault(maker.name, []).append(ran.result)
        return ran

    async def lone(self, maker, specs, seed, done):
        return await self.inner.lone(maker, specs, seed, done)


@dataclass
class Regime:
    """What a regime runs on: simulated engines charged by a latency model, or the engine on this machine."""

    name: str
    steps: tuple[int, ...]
    setup: object = None  # simulated: the SimSetup
    model: str | None = None  # live: the model every engine loads
    latency: object = None  # live: the LatencyModel the slo contenders predict with (measured once)

    def testbed(self, cfg: BenchConfig):
        if self.setup is not None:
            return simulated_testbed(cfg, self.setup)
        return live_testbed(replace(cfg, model=self.model, latency_model=self.latency))


def config(mix: Mix, contenders: list[Contender], folder: Path, seed: int, **extra) -> BenchConfig:
    return BenchConfig(argv=["regimes"], mix=mix, out=folder, contenders=contenders, seed=seed, progress=False,
                       **extra)


async def calibrate(regime: Regime, mix: Mix, contenders: list[Contender], batch: int, seed: int,
                    live_capacity_s: float, rounds: int = 1):
    """Standalone latency per step count, and each contender's saturated capacity (req/s).

    Live, capacity is measured in `rounds` rounds, the contenders' order rotating each round, and each contender
    gets the median of its rounds. A round's rate counts the denoising steps completed in the window, over the
    mix's mean steps per request: the count of requests completed in a short window also varies with how many
    long or short ones the draw put there (about 7% for 70 requests of 4/10/20 steps), which is not capacity."""
    with tempfile.TemporaryDirectory() as tmp:
        bed = regime.testbed(config(mix, contenders, Path(tmp), seed))
        idle = await measure_idle(bed.driver, bed.makers.reference, mix, progress=False, seed=seed)
        longest = max(i.latency_s for i in idle)
        if regime.setup is not None:  # simulated: exact, one round
            # a compute-bound full batch takes about `batch` lone requests: the window must hold several of them
            duration, warmup = max(60.0, 5.0 * longest * batch), 2.0 * longest * batch
            capacity = {}
            for c, maker in zip(contenders, bed.makers.contenders):
                cap = await measure_capacity(bed.driver, maker, mix, 2 * batch, duration, warmup, seed, False)
                capacity[c.name] = cap.rps
            return {i.steps: i.latency_s for i in idle}, capacity
        duration, warmup = max(live_capacity_s, 5.0 * longest), 2.0 * longest
        recorder = Recording(bed.driver)
        pairs = list(zip(contenders, bed.makers.contenders))
        mean_steps = sum(v * w for v, w in zip(mix.steps.values, mix.steps.weights)) / sum(mix.steps.weights)
        rates: dict[str, list[float]] = {}
        seen: dict[str, list[float]] = {}
        for k in range(rounds):
            for c, maker in pairs[k % len(pairs):] + pairs[:k % len(pairs)]:
                await measure_capacity(recorder, maker, mix, 2 * batch, duration, warmup, seed + k, False)
                ran = recorder.results[maker.name][-1]
                rates.setdefault(c.name, []).append(step_rate(ran) / mean_steps)
                seen.setdefault(c.name, []).append(batch_seen([o for o in ran.outcomes if o.status == OK]) or 0.0)
        print("  capacity rounds (req/s of the mix; mean batch a step ran in): " + ", ".join(
            f"{name} {' '.join(f'{r:.3g} ({b:.2g})' for r, b in zip(rs, seen[name]))}" for name, rs in rates.items()),
              file=sys.stderr, flush=True)
    return {i.steps: i.latency_s for i in idle}, {name: statistics.median(rs) for name, rs in rates.items()}


def run_cell(regime: Regime, mix, contenders, trace: Trace, warmup_s: float, seed: int, folder: Path,
             standalone: dict[int, float], repeats: int) -> dict[str, dict]:
    path = folder / "trace.jsonl"
    save_trace(trace, path)
    cfg = config(mix, contenders, folder, seed, load="trace", trace_file=str(path), warmup_s=warmup_s,
                 duration_s=trace.duration_s, repeats=repeats)
    bed = regime.testbed(cfg)
    bed.driver = Recording(bed.driver)
    asyncio.run(run_bench(cfg, bed))  # repeats rotate the contenders' order (bench.app)
    return {name: median_metrics([cell_metrics(r, standalone) for r in results])
            for name, results in bed.driver.results.items()}


def load_regime(name: str, batch: int, workdir: Path, noise: float = 0.0) -> Regime:
    if name in REGIMES:
        file, steps = REGIMES[name]
        return Regime(name, steps, setup=load_setup(MODELS / file, noise))
    model, steps = LIVE[name]
    if model == "tinyflux":  # built once (random weights, nothing downloaded): compute-bound at this size
        from stepserve.commands.tiny import quiet
        from stepserve.tiny.flux import BENCH_OPTIONS, build_tiny_flux

        folder = workdir / "tinyflux"
        if not (folder / "model_index.json").exists():
            with quiet():
                build_tiny_flux(folder, **BENCH_OPTIONS)
        model = str(folder)
    from stepserve.engine.config import resolve_latency_model
    from stepserve.engine.loading import default_threads, load_executor

    import torch

    torch.set_num_threads(default_threads())
    latency = resolve_latency_model("measure", load_executor(model), batch)  # what the slo contenders predict with
    return Regime(name, steps, model=model, latency=latency)


def run_regime(name: str, specs: list[str], args) -> list[dict]:
    regime = load_regime(name, args.max_batch_size, args.workdir, args.noise)
    mix = Mix.from_steps(list(args.steps or regime.steps))
    labels = {s: contender(s, args.max_batch_size) for s in specs}
    if "default" in labels:  # the contender the default resolves to is reported once, as the default
        labels = {s: c for s, c in labels.items() if s == "default" or c != labels["default"]}
    distinct = list({c.name: c for c in labels.values()}.values())
    standalone, capacity = asyncio.run(calibrate(regime, mix, distinct, args.max_batch_size, args.seed,
                                                 args.live_capacity_s, args.repeats))
    best = max((n for n in capacity if "#" not in n), key=capacity.get)  # a control copy is not a contender
    repeats = args.repeats if regime.setup is None else 1  # a simulated run repeats itself exactly
    rows = []
    for frac in args.loads:
        rate = frac * capacity[best]
        duration = max(args.min_duration, args.requests / rate)
        warmup = 0.1 * duration
        base = poisson_trace(mix, rate, warmup + duration, args.seed)
        for deadline in args.deadlines:
            items = base.items if not deadline else [
                TraceItem(it.offset_s, replace(it.spec, timeout_s=DEADLINE_X * standalone[it.spec.num_inference_steps]))
                for it in base.items]
            with tempfile.TemporaryDirectory() as tmp:
                cells = run_cell(regime, mix, distinct, Trace(items, base.description), warmup, args.seed,
                                 Path(tmp), standalone, repeats)
            for spec, c in labels.items():
                label = f"default={c.name}" if spec == "default" else c.name
                rows.append({"regime": name, "load": frac, "deadline": f"{DEADLINE_X:g}x" if deadline else "none",
                             "contender": label, "rate_rps": rate, "duration_s": duration, **cells[c.name]})
            print(f"  {name} load {frac:g} deadlines {deadline}: {rate:.3g} req/s, {duration:.0f} s a run",
                  file=sys.stderr, flush=True)
    meta = {"regime": name, "clock": "simulated" if regime.setup is not None else "live",
            "latency_model": REGIMES[name][0] if name in REGIMES else None, "model": regime.model,
            "steps": list(mix.steps.values), "repeats": repeats,
            "standalone_s": {str(k): v for k, v in standalone.items()}, "capacity_rps": capacity,
            "best_capacity": best}
    return [{"meta": meta}] + rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--regimes", default=",".join(REGIMES),
                   help=f"comma-separated: {', '.join(REGIMES)} (simulated), {', '.join(LIVE)} (live, slow)")
    p.add_argument("--repeats", type=int, default=3, help="live regimes: rounds per cell, contenders alternating")
    p.add_argument("--live-capacity-s", type=float, default=20.0, help="live regimes: capacity window per contender")
    p.add_argument("--workdir", type=Path, default=Path("bench-out/regimes"), help="live: where the tiny Flux is built")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help="names; dynamic:MS for a dynamic delay, slo:edf or slo:srs for slo's order; NAME#2 a second "
                        "copy of NAME as a control (how far two runs of one strategy differ)")
    p.add_argument("--loads", default=",".join(map(str, LOADS)), help="fractions of the best capacity")
    p.add_argument("--deadlines", default="none,3x", help="which cells: none (no deadlines), 3x (deadlines of "
                   "3x the standalone latency), or both")
    p.add_argument("--steps", help="override every regime's step counts, e.g. 8,20")
    p.add_argument("--requests", type=int, default=200, help="about this many requests per run (sets the duration)")
    p.add_argument("--min-duration", type=float, default=60.0, help="simulated seconds per run at least")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", type=float, default=0.0,
                   help="simulated: charge each stage with this much of its measured spread (1: as profiled)")
    p.add_argument("--json", type=Path, help="write the rows (and the regimes' metadata) to this file")
    p.add_argument("--png", type=Path, help="draw the matrix to this file (benchmarks/regimes_plot.py)")
    args = p.parse_args(argv)
    args.loads = [float(x) for x in args.loads.split(",")]
    allowed = {"none": False, f"{DEADLINE_X:g}x": True}
    try:
        args.deadlines = [allowed[x.strip()] for x in args.deadlines.split(",")]
    except KeyError as exc:
        p.error(f"--deadlines: {exc.args[0]!r} is not a cell; allowed: {', '.join(allowed)}")
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
    text, within, better, n = verdict(rows)
    print(text)
    gaps = controls(rows)
    if gaps:
        print("\n" + gaps)
    print(f"\nthe default within the margins in {within} of {n} cells; >=10% better than every fixed alternative "
          f"in {better}")
    print("within the margins of the best, per contender (cells of " + str(n) + "): " + ", ".join(
        f"{name} {count}" for name, count in sorted(standings(rows).items(), key=lambda kv: -kv[1])))
    print(f"\nwall time {wall:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv, "wall_s": wall,
                                         "deadline_x_standalone": DEADLINE_X, "regimes": metas, "rows": rows},
                                        indent=1) + "\n")
    if args.png:
        from regimes_plot import plot_regimes

        plot_regimes(rows, args.png, simulated=all(m["clock"] == "simulated" for m in metas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
