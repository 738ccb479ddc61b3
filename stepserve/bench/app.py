"""A whole benchmark: load the model once, measure idle latency and capacity, replay the identical load for
every contender (repeats rotate the order), optionally sweep the rate, then write the report files.

Deadlines: with `timeout_s` (or `timeout_slo`: the deadline is the SLO, measured first) every request of every run
carries that timeout_s; idle latency and capacity are measured without. In process, `slo` contenders predict
with one latency model, measured once on the shared executor (or loaded from a file) and given to each of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fleet_view import REPLICA_LOAD, plot_replica_load
from .repeats import summarize_repeats
from .quality import add_quality
from .plots import (BATCH_SIZE_OVER_TIME, LATENCY_CDF, THROUGHPUT_VS_LATENCY, plot_batch_sizes, plot_latency_cdf,
                    plot_throughput_vs_latency)
from .report import conclusions, write_report
from .report_html import write_report_html
from .resources import capture_environment
from .results import BenchResults, BenchSettings, CdfSeries, Startup, write_json
from .runner import ContenderRun, LoadPlan, measure_capacity, measure_idle, rotate, run_contender
from .sweep import SweepSpec, run_sweep
from .config import BenchConfig
from .live_bed import live_testbed
from .testbed import Described, Testbed
from .trace_files import load_trace, save_trace
from .workload import poisson_trace

LATENCY_MODEL_FILE = "latency_model.json"  # in --out: the latency model the slo contenders predicted with


@dataclass
class BenchRun:
    results: BenchResults
    runs: list[ContenderRun]
    plan: LoadPlan
    latency_model: Any = None  # what the slo contenders predicted with (written as latency_model.json)


async def run_bench(cfg: BenchConfig, bed: Testbed | None = None) -> BenchRun:
    """The whole benchmark on a testbed (default: live_testbed(cfg)); the simulator passes its own."""
    bed = bed or live_testbed(cfg)
    env = capture_environment(cfg.argv, bed.environment)
    driver, startup = bed.driver, bed.startup
    makers, reference = bed.makers.contenders, bed.makers.reference

    idle = await measure_idle(driver, reference, cfg.mix, progress=cfg.progress, seed=cfg.seed)
    slo_s, slo_rule = slo_from(cfg, idle)
    drain_s = cfg.drain_s if cfg.drain_s is not None else max(5.0, 3.0 * slo_s)
    timeout_s, timeout_rule = _deadline(cfg, slo_s)

    capacity = None
    needs_capacity = (cfg.load == "poisson" and cfg.rate is None) or (cfg.sweep and not cfg.sweep_rates)
    if needs_capacity:
        batch = max((c.max_batch_size for c in cfg.contenders), default=8)
        longest_s = max(i.latency_s for i in idle)
        # Long enough for many requests to finish, with a warm-up that fills every batch slot first.
        duration = max(cfg.capacity_duration_s, 5.0 * longest_s)
        capacity = await measure_capacity(driver, reference, cfg.mix, 2 * batch, duration,
                                          max(2.0, 2.0 * longest_s), cfg.seed, cfg.progress)
        if capacity.completed < 3:
            # Where batching gains nothing (a compute-bound model) a full batch takes about `batch` times a lone
            # request, so a window sized on the lone request can end before the first batch does: measure
            # once more with the window and warm-up scaled by the batch size.
            duration *= batch
            capacity = await measure_capacity(driver, reference, cfg.mix, 2 * batch, duration,
                                              max(2.0, 2.0 * longest_s) * batch, cfg.seed, cfg.progress)
        if capacity.completed < 3:
            raise ValueError(f"the capacity measurement completed only {capacity.completed} requests in "
                             f"{duration:g} s; give a longer --capacity-duration, or an absolute --rate")

    plan = _plan(cfg, capacity.rps if capacity else None, drain_s, timeout_s)
    plan.slo_s = slo_s
    runs: list[ContenderRun] = []
    for repeat in range(cfg.repeats):
        for maker in rotate(makers, repeat):
            label = f"{maker.name} (repeat {repeat + 1}/{cfg.repeats})" if cfg.repeats > 1 else maker.name
            run = await run_contender(driver, maker, plan, repeat, slo_s, cfg.progress, label)
            startup.engine_start_s.append(run.engine_start_s)
            runs.append(run)

    settings = _settings(cfg, plan.rate_rps, drain_s, slo_rule, bed.described)
    settings.timeout_s, settings.timeout_rule = timeout_s, timeout_rule
    settings.own_slo_requests = plan.trace.own_slos if plan.trace is not None else 0
    if bed.makers.latency_model is not None:
        settings.latency_model = bed.makers.latency_model_source + " (saved as latency_model.json)"
    results = assemble_results(cfg, env, settings, startup, plan, slo_s, idle, capacity, runs,
                               [m.name for m in makers])
    if cfg.quality and bed.makers.uncached is not None:
        add_quality(results, runs, bed.makers.uncached)

    if cfg.sweep:
        spec = _sweep_spec(cfg, capacity.rps if capacity else None, drain_s)
        spec.timeout_s = timeout_s
        sweep = await run_sweep(driver, makers, cfg.mix, spec, slo_s, cfg.progress)
        settings.sweep_rates_rps = sorted({p.rate_rps for p in sweep.points})
        results.sweep, results.knees = sweep.points, sweep.knees
        startup.engine_start_s += [r.engine_start_s for r in sweep.runs]
    results.conclusions = conclusions(results)
    return BenchRun(results, runs, plan, bed.makers.latency_model)


def assemble_results(cfg: BenchConfig, env, settings: BenchSettings, startup: Startup, plan: LoadPlan,
                     slo_s: float, idle: list, capacity, runs: list[ContenderRun], order: list[str]) -> BenchResults:
    """The results of every contender's runs, in contender order: per-run metrics, summaries over repeats, CDFs
    and the first repeat's timeline. Shared by the live bench and the simulator, so both write one schema."""
    warm = sum(1 for it in plan.trace.items if it.offset_s < cfg.warmup_s) if plan.trace else None
    warm_note = (f"Warm-up excluded: requests scheduled in the first {cfg.warmup_s:g} s of every run"
                 + (f" ({warm} per run)" if warm is not None else "") + " are sent but not counted.")
    results = BenchResults(environment=env, settings=settings, startup=startup, load_description=plan.description,
                           slo_s=slo_s, warmup_note=warm_note, idle=idle, capacity=capacity)
    results.runs = sorted((r.metrics for r in runs), key=lambda m: (order.index(m.contender), m.repeat))
    for name in order:
        mine = [r for r in results.runs if r.contender == name]
        results.summaries.append(summarize_repeats(mine, capacity.rps if capacity else None))
        results.cdf.append(CdfSeries(name, sorted(v for r in mine for v in r.latencies_s)))
        first = next(r for r in runs if r.metrics.contender == name and r.metrics.repeat == 0)
        results.timelines.append(first.timeline)
    return results


def slo_from(cfg: BenchConfig, idle: list) -> tuple[float, str]:
    """The run's p95 SLO in seconds and how it was chosen: --slo-p95-ms, else a multiple of the idle latency of
    the longest request in the mix (measured live, or simulated)."""
    if cfg.slo_p95_ms is not None:
        return cfg.slo_p95_ms / 1000.0, f"p95 <= {cfg.slo_p95_ms:g} ms (given)"
    longest = max(idle, key=lambda i: i.latency_s)
    return (cfg.slo_x_idle * longest.latency_s,
            f"p95 <= {cfg.slo_x_idle:g} x the idle latency of the longest request in the mix ({longest.steps} steps)")


def _deadline(cfg: BenchConfig, slo_s: float) -> tuple[float | None, str | None]:
    """Every request's timeout_s and how it was chosen, or (None, None) without deadlines."""
    if cfg.timeout_slo:
        return slo_s, "--timeout-slo: the run's SLO"
    if cfg.timeout_s is not None:
        return cfg.timeout_s, "--timeout-s"
    return None, None


def _sweep_spec(cfg: BenchConfig, capacity_rps: float | None, drain_s: float) -> SweepSpec:
    grid = cfg.sweep_rates or [round(capacity_rps * f, 4) for f in cfg.sweep_fracs]
    cap = capacity_rps or 1.0
    return SweepSpec(grid_rps=grid, start_rps=round(cap * cfg.sweep_start_frac, 4), factor=cfg.sweep_factor,
                     max_rps=round(cap * cfg.sweep_max_frac, 4), refine=cfg.sweep_refine, warmup_s=cfg.warmup_s,
                     duration_s=cfg.sweep_duration_s or cfg.duration_s, drain_s=drain_s, seed=cfg.seed,
                     min_requests=cfg.sweep_min_requests)


def _plan(cfg: BenchConfig, capacity_rps: float | None, drain_s: float, timeout_s: float | None = None) -> LoadPlan:
    if cfg.load == "closed":
        return LoadPlan("closed", cfg.mix, cfg.seed, cfg.warmup_s, cfg.duration_s, drain_s, users=cfg.users,
                        timeout_s=timeout_s)
    if cfg.load == "trace":
        trace = load_trace(cfg.trace_file).with_timeout(timeout_s)
        return LoadPlan("open", cfg.mix, cfg.seed, cfg.warmup_s, trace.duration_s, drain_s, trace=trace,
                        timeout_s=timeout_s)
    rate = cfg.rate if cfg.rate is not None else (cfg.rate_frac or 0.7) * capacity_rps
    trace = poisson_trace(cfg.mix, rate, cfg.warmup_s + cfg.duration_s, cfg.seed)
    if capacity_rps and cfg.rate is None:
        trace.description += f" ({(cfg.rate_frac or 0.7) * 100:.0f}% of measured capacity {capacity_rps:.2f} req/s)"
    return LoadPlan("open", cfg.mix, cfg.seed, cfg.warmup_s, cfg.duration_s, drain_s,
                    trace=trace.with_timeout(timeout_s), rate_rps=rate, timeout_s=timeout_s)


def _settings(cfg: BenchConfig, rate: float | None, drain_s: float, slo_rule: str,
              where: Described) -> BenchSettings:
    return BenchSettings(peers=where.peers,
        target=where.target, model=where.model, device=where.device, dtype=where.dtype, backend=where.backend,
        contenders=[] if cfg.targets or cfg.peers else list(cfg.contenders), mix=cfg.mix.to_dict(), load=cfg.load,
        rate_rps=rate, rate_frac=cfg.rate_frac, users=cfg.users if cfg.load == "closed" else None,
        trace_file=cfg.trace_file, duration_s=cfg.duration_s, warmup_s=cfg.warmup_s, drain_s=drain_s,
        repeats=cfg.repeats, seed=cfg.seed, slo_rule=slo_rule, sweep=cfg.sweep)


def write_outputs(run: BenchRun, out: Path) -> list[Path]:
    """results.json, report.md, latency_cdf.png, and when they apply: throughput_vs_latency.png (sweep),
    batch_size_over_time.png (in-process), trace.jsonl (the open-loop trace every contender replayed),
    latency_model.json (what the slo contenders predicted with); last report.html, the report with its plots."""
    results = run.results
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "report.md", out / LATENCY_CDF]
    write_json(results, written[0])
    write_report(results, written[1])
    simulated = results.simulated  # every title says so
    plot_latency_cdf(results.cdf, results.slo_s, written[2], f"Latency CDF ({results.load_description})", simulated)
    if results.sweep:
        written.append(out / THROUGHPUT_VS_LATENCY)
        plot_throughput_vs_latency(results.sweep, results.slo_s, written[-1], simulated)
    if any(t.t_s for t in results.timelines):
        written.append(out / BATCH_SIZE_OVER_TIME)
        plot_batch_sizes(results.timelines, written[-1], simulated)
    if any(getattr(m, "fleet", None) is not None for m in results.runs):
        written.append(out / REPLICA_LOAD)
        plot_replica_load(results.runs, written[-1])
    if run.plan.trace is not None:
        written.append(out / "trace.jsonl")
        save_trace(run.plan.trace, written[-1])
    if run.latency_model is not None:
        written.append(out / LATENCY_MODEL_FILE)
        run.latency_model.save(written[-1])
    written.append(out / "report.html")  # the report with its plots embedded
    write_report_html(written[1], [p for p in written if p.suffix == ".png"], written[-1])
    return written
