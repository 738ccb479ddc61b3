"""`stepserve demo`: the strategy comparison on the embedded model, in a few minutes on a laptop CPU.

It loads the model, measures the idle latency of each step count in a mixed workload (8/20/40 steps) and the
saturated capacity of continuous batching, then replays one seeded open-loop trace at ~70% of that capacity
against the default strategy (slo: cost- and deadline-aware), continuous, dynamic (several max_queue_delay
values), static and no batching. It prints the summary and
writes the full report (tables, plots, results.json, a sheet of the generated images) to the output folder.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from ..bench.app import BenchRun, run_bench, write_outputs
from ..bench.config import BenchConfig
from ..bench.repeats import ContenderSummary
from ..bench.report_format import fmt, plain
from ..bench.report_pace import realised_text
from ..bench.samples import samples_section, write_samples
from ..bench.targets import Contender
from ..bench.workload import Mix
from ..util.interrupts import INTERRUPTED, sigterm_as_ctrl_c
from ..scheduling import DEFAULT_STRATEGY
from .flags import DefaultsHelpFormatter

DEFAULT_OUT = Path("bench-out") / "demo"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"stepserve demo: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stepserve demo", description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default="embedded", help="embedded | PATH to a diffusers folder | fake (no model)")
    p.add_argument("--steps", default="8,20,40", help="step counts of the mixed workload")
    p.add_argument("--rate-frac", type=float, default=0.7, help="offered load as a fraction of continuous capacity")
    p.add_argument("--max-batch-size", type=int, default=8, help="most requests in one denoising step")
    p.add_argument("--dynamic-delays-ms", default="10,50,200", help="dynamic batching contenders (max_queue_delay)")
    p.add_argument("--duration", type=float, default=20.0,
                   help="measured seconds per strategy; each run lasts --warmup + --duration, then drains")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the measured --duration")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals, the request mix and the images")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: all cores but one)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the report, plots and image sheet")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def config_from_args(argv: list[str]) -> BenchConfig:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        steps = [int(s) for s in args.steps.split(",") if s.strip()]
        delays = [float(d) for d in args.dynamic_delays_ms.split(",") if d.strip()]
    except ValueError:
        p.error("--steps/--dynamic-delays-ms: expected comma-separated numbers, e.g. 8,20,40")
    if not steps or any(s < 1 for s in steps) or any(d < 0 for d in delays):
        p.error("--steps: positive integers; --dynamic-delays-ms: numbers >= 0")
    for flag, value in (("--rate-frac", args.rate_frac), ("--duration", args.duration),
                        ("--max-batch-size", args.max_batch_size), ("--threads", args.threads)):
        if value is not None and not value > 0:
            p.error(f"{flag}: must be > 0, got {value:g}")
    b = args.max_batch_size
    contenders = [Contender(DEFAULT_STRATEGY, b), Contender("continuous", b)]
    contenders += [Contender("dynamic", b, max_queue_delay_ms=d) for d in delays]
    contenders += [Contender("static", b), Contender("none", b)]
    return BenchConfig(argv=["demo", *argv], mix=Mix.from_steps(steps), out=args.out, model=args.model,
                       contenders=contenders, load="poisson", rate_frac=args.rate_frac, duration_s=args.duration,
                       warmup_s=args.warmup, seed=args.seed, capacity_duration_s=8.0,
                       progress=not args.no_progress, keep_images=True, threads=args.threads)


def summary_table(summaries: list[ContenderSummary]) -> str:
    header = f"{'strategy':<16}{'done/sent':>10}{'p50':>10}{'p95':>10}{'p99':>10}{'thru/s':>9}{'in SLO':>9}{'batch':>7}"
    lines = [header, "-" * len(header)]
    for s in summaries:
        batch = "n/a" if s.mean_batch_size.median is None else f"{s.mean_batch_size.median:.1f}"
        lines.append(f"{s.contender:<16}{f'{s.completed}/{s.offered}':>10}{fmt(s.p50_s.median, 'time'):>10}"
                     f"{fmt(s.p95_s.median, 'time'):>10}{fmt(s.p99_s.median, 'time'):>10}"
                     f"{s.throughput_rps.median:>9.2f}{fmt(s.slo_attainment.median, 'share'):>9}{batch:>7}")
    return "\n".join(lines)


def headline(run: BenchRun) -> list[str]:
    """The default and continuous against the best dynamic setting, in ratios (absolute times vary from machine
    to machine)."""
    by_name = {s.contender: s for s in run.results.summaries}
    dynamic = [s for s in run.results.summaries if s.contender.startswith("dynamic") and s.p95_s.median]
    if not dynamic:
        return []
    best50 = min(dynamic, key=lambda s: s.p50_s.median)
    best95 = min(dynamic, key=lambda s: s.p95_s.median)
    out = []
    for name, label in ((DEFAULT_STRATEGY, f"{DEFAULT_STRATEGY} (the default)"), ("continuous", "continuous")):
        mine = by_name.get(name)
        if mine is not None and mine.p50_s.median and mine.p95_s.median:
            out.append(f"{label} vs the best dynamic setting: p50 {mine.p50_s.median / best50.p50_s.median:.2f}x "
                       f"({best50.contender}), p95 {mine.p95_s.median / best95.p95_s.median:.2f}x "
                       f"({best95.contender})")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = config_from_args(argv)
    print(f"stepserve demo: {cfg.model} model; mixed workload {'/'.join(map(str, cfg.mix.steps.values))} steps; "
          f"open-loop Poisson at {cfg.rate_frac:.0%} of continuous capacity; "
          f"{cfg.duration_s:g} s measured per strategy after {cfg.warmup_s:g} s warm-up", file=sys.stderr)
    try:
        with sigterm_as_ctrl_c():
            run = asyncio.run(run_bench(cfg))
    except FileNotFoundError as exc:
        print(f"stepserve demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stepserve demo: interrupted", file=sys.stderr)
        return INTERRUPTED
    files = write_outputs(run, cfg.out)
    sheet = write_samples(run.runs, cfg.out / "samples.png")
    if sheet is not None:
        files.append(sheet.path)
        with open(cfg.out / "report.md", "a") as report:
            report.write("\n" + "\n".join(samples_section(sheet)))
    r = run.results
    realised = realised_text(r)
    print()
    print(f"Load: {r.load_description}" + (f"; {realised}" if realised else ""))
    print(f"SLO: {r.settings.slo_rule} = {fmt(r.slo_s, 'time')}; idle latency: "
          + ", ".join(f"{i.steps} steps {fmt(i.latency_s, 'time')}" for i in r.idle))
    print()
    print(summary_table(r.summaries))
    print()
    for line in headline(run) + r.conclusions:
        print(plain(line))
    if sheet is not None:
        print(plain(samples_section(sheet)[-2]))
    print(f"\nReport: {cfg.out / 'report.md'}  (also: {', '.join(f.name for f in files if f.name != 'report.md')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
