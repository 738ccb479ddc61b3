"""`stepserve bench` on a simulated clock: the same workload, contenders, SLO rule and outputs, with every engine
an EngineCore of the real policies around an executor that charges a LatencyModel instead of running networks.

It follows bench.app.run_bench step by step (idle latency, capacity, the identical trace for every contender,
repeats rotated) and hands the same records to the bench's metrics, results and report code, so a simulated
results.json compares line by line with a measured one. What differs: no wall clock (time is simulated and
starts at 0 for every run), no sender lag, no CPU/GPU usage, engine start-up costs 0 s.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from ..api import EngineOptions
from ..async_engine import DEFAULT_ANSWER_MARGIN_S
from ..bench.app import (
    BenchConfig,
    BenchRun,
    _deadline,
    _plan,
    _settings,
    _sweep_spec,
    assemble_results,
    slo_from,
)
from ..bench.load import LoadResult
from ..bench.metrics import Usage, summarize, window_rates
from ..bench.report import conclusions
from ..bench.resources import capture_environment
from ..bench.results import (
    BatchTimeline,
    Capacity,
    IdleLatency,
    Startup,
)
from ..bench.runner import NO_DEADLINE_S, ContenderRun, LoadPlan, rotate
from ..bench.sweep import SweepResult, SweepSpec, _Sweeper, find_knee, point_from_run
from ..bench.targets import OK, Contender
from ..bench.workload import Mix, Trace, TraceItem, poisson_trace, user_requests
from ..costs import FakeExecutor, LatencyModel, model_for
from ..engine import EngineCore
from ..types import ModelInfo
from .drive import Driven, drive_closed, drive_open

IDLE_SAMPLES = 3  # lone requests per step count, after one unmeasured (as bench.runner.measure_idle)


@dataclass
class SimSetup:
    """What every simulated engine is built from."""

    latency: LatencyModel
    model: ModelInfo
    noise: float = 0.0  # spread of the charged costs (see stepserve.costs.LatencyCharges); 0: exactly the model
    source: str = ""  # where the latency model came from, for the report


def make_executor(setup: SimSetup, seed: int):
    return FakeExecutor.charging(setup.latency, setup.noise, seed)


def make_core(setup: SimSetup, contender: Contender, seed: int) -> EngineCore:
    """A fresh engine as EngineTarget builds one (same options, same answer margin), on the simulated executor."""
    options = contender.engine_options()
    if contender.strategy == "slo":
        options["latency_model"] = setup.latency
    return EngineOptions(answer_margin_s=DEFAULT_ANSWER_MARGIN_S, **options).make_core(make_executor(setup, seed))


def simulate_idle(setup: SimSetup, reference: Contender, mix: Mix, seed: int) -> list[IdleLatency]:
    """Latency of a lone request at each step count of the mix, as bench.runner.measure_idle measures it."""
    out = []
    for steps in sorted({int(s) for s in mix.steps.values}):
        spec = mix.heaviest(steps)
        spec.timeout_s = NO_DEADLINE_S
        core = make_core(setup, reference, seed)
        times = []
        for i in range(IDLE_SAMPLES + 1):
            spec.seed = i
            driven = drive_open(core, Trace([TraceItem(0.0, replace(spec))]), 0.0, NO_DEADLINE_S)
            o = driven.outcomes[0]
            if o.status != OK:
                raise ValueError(f"idle request ({steps} steps) failed in simulation: {o.reply.error}")
            if i > 0:
                times.append(o.latency_s)
        out.append(IdleLatency(steps, statistics.median(times), len(times)))
    return out


def simulate_capacity(setup: SimSetup, reference: Contender, mix: Mix, users: int, duration_s: float,
                      warmup_s: float, seed: int) -> Capacity:
    """Saturated throughput as bench.runner.measure_capacity measures it: a closed loop of `users` users."""
    plan = LoadPlan("closed", mix, seed, warmup_s, duration_s, drain_s=0.0, users=users, timeout_s=NO_DEADLINE_S)
    driven = _drive(make_core(setup, reference, seed), plan)
    result = _load_result(driven, plan)
    completed = sum(1 for o in result.measured if o.status == OK)
    return Capacity(reference.name, window_rates(result, None).throughput_rps, users, duration_s, completed)


def _drive(core: EngineCore, plan: LoadPlan) -> Driven:
    if plan.mode == "open":
        end_s = max(plan.trace.duration_s, plan.warmup_s)
        return drive_open(core, plan.trace, plan.warmup_s, end_s + plan.drain_s)
    users = [user_requests(plan.mix, plan.seed, u, plan.timeout_s) for u in range(plan.users)]
    end_s = plan.warmup_s + plan.duration_s
    return drive_closed(core, users, plan.warmup_s, end_s, end_s + plan.drain_s)


def _load_result(driven: Driven, plan: LoadPlan) -> LoadResult:
    if plan.mode == "open":
        return LoadResult(driven.outcomes, 0.0, plan.warmup_s, max(plan.trace.duration_s, plan.warmup_s),
                          "open-loop", plan.trace.description)
    return LoadResult(driven.outcomes, 0.0, plan.warmup_s, plan.warmup_s + plan.duration_s, "closed-loop",
                      f"closed-loop, {plan.users} users for {plan.duration_s:g} s")


def simulate_contender(setup: SimSetup, contender: Contender, plan: LoadPlan, repeat: int,
                       slo_s: float | None) -> ContenderRun:
    """One bench run of one contender, simulated; the executor's noise is seeded by (seed, repeat)."""
    core = make_core(setup, contender, plan.seed * 1000 + repeat)
    driven = _drive(core, plan)
    result = _load_result(driven, plan)
    metrics = summarize(result, contender.name, repeat, slo_s, driven.samples, None, driven.end_time, Usage())
    timeline = BatchTimeline(contender.name, [round(s.t, 4) for s in driven.samples],
                             [s.batch_size for s in driven.samples])
    return ContenderRun(metrics, timeline, 0.0)


def run_simulation(cfg: BenchConfig, setup: SimSetup) -> BenchRun:
    """bench.app.run_bench on simulated engines; the same BenchRun, for bench.app.write_outputs."""
    env = capture_environment(cfg.argv, "simulated")
    startup = Startup(model_load_s=None)
    batch = max((c.max_batch_size for c in cfg.contenders), default=8)
    reference = Contender("continuous", max_batch_size=batch)

    idle = simulate_idle(setup, reference, cfg.mix, cfg.seed)
    slo_s, slo_rule = slo_from(cfg, idle)
    drain_s = cfg.drain_s if cfg.drain_s is not None else max(5.0, 3.0 * slo_s)
    timeout_s, timeout_rule = _deadline(cfg, slo_s)

    capacity = None
    if (cfg.load == "poisson" and cfg.rate is None) or (cfg.sweep and not cfg.sweep_rates):
        longest_s = max(i.latency_s for i in idle)
        duration = max(cfg.capacity_duration_s, 5.0 * longest_s)
        capacity = simulate_capacity(setup, reference, cfg.mix, 2 * batch, duration, max(2.0, 2.0 * longest_s),
                                     cfg.seed)
        if capacity.completed < 3:
            raise ValueError(f"the simulated capacity measurement completed only {capacity.completed} requests in "
                             f"{duration:g} s; give a longer --capacity-duration, or an absolute --rate")

    plan = _plan(cfg, capacity.rps if capacity else None, drain_s, timeout_s)
    runs: list[ContenderRun] = []
    for repeat in range(cfg.repeats):
        for contender in rotate(list(cfg.contenders), repeat):
            run = simulate_contender(setup, contender, plan, repeat, slo_s)
            startup.engine_start_s.append(run.engine_start_s)
            runs.append(run)

    settings = _settings(cfg, plan.rate_rps, drain_s, slo_rule)
    settings.target = f"simulated engine, {setup.source}"
    meta = setup.latency.metadata
    settings.model, settings.device = setup.model.name, f"simulated ({meta.get('device') or 'profiled device'})"
    settings.dtype, settings.backend = str(meta.get("dtype") or "n/a"), "latency model"
    settings.timeout_s, settings.timeout_rule = timeout_s, timeout_rule
    settings.latency_model = f"{setup.source}; every engine charged it" + (
        f" with noise {setup.noise:g}" if setup.noise else "") + " (saved as latency_model.json)"
    results = assemble_results(cfg, env, settings, startup, plan, slo_s, idle, capacity, runs,
                               [c.name for c in cfg.contenders])
    if cfg.sweep:
        spec = _sweep_spec(cfg, capacity.rps if capacity else None, drain_s)
        spec.timeout_s = timeout_s
        sweep = simulate_sweep(setup, list(cfg.contenders), cfg.mix, spec, slo_s)
        settings.sweep_rates_rps = sorted({p.rate_rps for p in sweep.points})
        results.sweep, results.knees = sweep.points, sweep.knees
        startup.engine_start_s += [r.engine_start_s for r in sweep.runs]
    results.conclusions = conclusions(results)
    return BenchRun(results, runs, plan, setup.latency)


class _SimulatedSweeper(_Sweeper):
    """The bench's rate search and grid (bench.sweep), each point a simulated run instead of a live one."""

    def __init__(self, setup: SimSetup, mix: Mix, spec: SweepSpec, slo_s: float, out: SweepResult) -> None:
        super().__init__(mix, spec, slo_s, False, out)
        self.setup = setup

    async def point(self, contender: Contender, rate: float) -> bool:  # awaits nothing: no real time passes
        s = self.spec
        duration = max(s.duration_s, s.min_requests / rate)
        trace = poisson_trace(self.mix, rate, s.warmup_s + duration, s.seed).with_timeout(s.timeout_s)
        plan = LoadPlan("open", self.mix, s.seed, s.warmup_s, duration, s.drain_s, trace=trace)
        run = simulate_contender(self.setup, contender, plan, 0, self.slo_s)
        point = point_from_run(run, rate, self.slo_s)
        self.out.points.append(point)
        self.out.runs.append(run)
        return point.held


def simulate_sweep(setup: SimSetup, contenders: list[Contender], mix: Mix, spec: SweepSpec,
                   slo_s: float) -> SweepResult:
    """bench.sweep.run_sweep on simulated runs: the same rates tried in the same order, the same knees."""
    import asyncio

    out = SweepResult()
    sweeper = _SimulatedSweeper(setup, mix, spec, slo_s, out)
    for contender in contenders:
        asyncio.run(sweeper.grid(contender) if spec.grid_rps else sweeper.search(contender))
        out.knees.append(find_knee(contender.name, out.points))
    return out


def load_setup(path: str | Path, noise: float = 0.0) -> SimSetup:
    """The latency model file (LatencyModel.save / `stepserve profile`); a bad file raises ValueError saying why."""
    latency = LatencyModel.load(path)
    return SimSetup(latency, model_for(latency), noise, f"latency model loaded from {path}")
