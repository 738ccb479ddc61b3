"""`stepserve bench` on a simulated clock: the bench's own runner (bench.app.run_bench) on a simulated testbed,
every engine an EngineCore of the real policies around the fake executor charging a LatencyModel.

So the workload, contenders, SLO rule, idle latency, capacity, repeats, sweep, results and report are the
bench's code, and a simulated results.json compares line by line with a measured one. What differs is the
driver: no wall clock (time is simulated and starts at 0 for every run), no sender lag, no CPU/GPU usage,
engine start-up costs 0 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..engine.async_engine import DEFAULT_ANSWER_MARGIN_S
from ..bench.app import BenchRun, run_bench
from ..bench.config import BenchConfig
from ..bench.load import LoadResult, Outcome
from ..bench.metrics import Usage
from ..bench.results import SIMULATED, Startup
from ..bench.runner import NO_DEADLINE_S, LoadPlan, LoadRun, TargetMaker
from ..bench.targets import Contender, Reply
from ..bench.testbed import Described, Makers, Testbed
from ..bench.workload import RequestSpec, Trace, TraceItem, user_requests
from ..costs import FakeExecutor, LatencyModel, model_for
from ..engine.core import EngineCore
from ..engine.config import EngineOptions
from ..scheduling.device_share import DeviceShare
from ..util.words import plural
from .device import Models
from .drive import Driven, drive_closed, drive_open
from .fleet_run import FleetSettings, build_fleet, finish_report


@dataclass
class SimSetup:
    """What every simulated engine is built from."""

    latency: LatencyModel
    noise: float = 0.0  # spread of the charged costs (see stepserve.costs.LatencyCharges); 0: exactly the model
    source: str = ""  # where the latency model came from, for the report
    fleet: FleetSettings | None = None  # every contender a fleet of replicas (sim.fleet_run); None: one engine
    # several models on every replica (sim.device): name -> the latency model its engine charges (the first: the
    # default for requests that name none; `latency` is its), and their device share weights; None: one model
    models: dict[str, LatencyModel] | None = None
    weights: dict[str, float] = field(default_factory=dict)


def load_setup(path: str | Path, noise: float = 0.0) -> SimSetup:
    """The latency model file (LatencyModel.save / `stepserve profile`); a bad file raises ValueError saying why."""
    return SimSetup(LatencyModel.load(path), noise, f"latency model loaded from {path}")


def make_executor(setup: SimSetup, seed: int) -> FakeExecutor:
    return FakeExecutor.charging(setup.latency, setup.noise, seed)


def load_models(paths: dict[str, str | Path], weights: dict[str, float], noise: float = 0.0) -> SimSetup:
    """Several models on every simulated replica: name -> latency model file (the first: the default model)."""
    models = {name: LatencyModel.load(path) for name, path in paths.items()}
    DeviceShare(weights)  # bad weights fail here, before any run
    first = next(iter(paths))
    return SimSetup(models[first], noise, "models " + ", ".join(f"{n} (latency model {p})" for n, p in paths.items()),
                    models=models, weights=dict(weights))


def make_core(setup: SimSetup, contender: Contender, seed: int) -> EngineCore | Models:
    """A fresh engine as EngineTarget builds one (same options, same answer margin), on the simulated executor;
    with several models, one such engine per model sharing the replica's device (sim.device.Models)."""
    if setup.models:
        return Models({name: make_core(replace(setup, latency=latency, models=None), contender, seed)
                       for name, latency in setup.models.items()}, DeviceShare(setup.weights))
    options = contender.engine_options()
    if contender.strategy == "slo":
        options["latency_model"] = setup.latency
    return EngineOptions(answer_margin_s=DEFAULT_ANSWER_MARGIN_S, **options).make_core(make_executor(setup, seed))


def contender_maker(contender: Contender) -> TargetMaker:
    """On the simulated clock a target is the contender its engine is built from."""
    return TargetMaker(contender.name, lambda: contender)


class SimulatedDriver:
    """bench.runner.Driver on a simulated clock: a fresh simulated engine per run, seeded by `seed`."""

    def __init__(self, setup: SimSetup) -> None:
        self.setup = setup

    async def run(self, maker: TargetMaker, plan: LoadPlan, seed: int, done: Callable[[Outcome], None]) -> LoadRun:
        contender, settings = maker.make(), self.setup.fleet
        fleet = report = None
        users = plan.users
        end_s = max(plan.trace.duration_s, plan.warmup_s) if plan.mode == "open" else plan.warmup_s + plan.duration_s
        if settings is not None and settings.autoscale is not None and getattr(plan, "slo_s", None) is None:
            settings = replace(settings, autoscale=None)  # the capacity measurement: the replicas it starts with
        if settings is not None and settings.active:
            core, fleet, report = build_fleet(settings, self.setup.latency,
                                              lambda r: make_core(self.setup, contender, seed * 1000 + r),
                                              getattr(plan, "slo_s", None), seed, end_s + plan.drain_s)
            users *= settings.replicas  # a closed loop (the capacity measurement too) keeps every replica busy
        else:
            core = make_core(self.setup, contender, seed)
        if plan.mode == "open":
            driven = drive_open(core, plan.trace, plan.warmup_s, end_s + plan.drain_s, fleet)
            result = LoadResult(driven.outcomes, 0.0, plan.warmup_s, end_s, "open-loop", plan.trace.description)
        else:
            requests = [user_requests(plan.mix, plan.seed, u, plan.timeout_s) for u in range(users)]
            driven = drive_closed(core, requests, plan.warmup_s, end_s, end_s + plan.drain_s, fleet)
            result = LoadResult(driven.outcomes, 0.0, plan.warmup_s, end_s, "closed-loop",
                                f"closed-loop, {plural(users, 'user')} for {plan.duration_s:g} s")
        _report(driven, done)
        run = LoadRun(result, driven.samples, None, driven.end_time, Usage())
        if report is not None:
            run.fleet = finish_report(report, fleet, driven.end_time, driven.lost_failed)
        return run

    async def lone(self, maker: TargetMaker, specs: list[RequestSpec], seed: int,
                   done: Callable[[], None]) -> list[tuple[Reply, float]]:
        core = make_core(self.setup, maker.make(), seed)
        out = []
        for spec in specs:  # each alone: the engine is idle again before the next one
            o = drive_open(core, Trace([TraceItem(0.0, spec)]), 0.0, NO_DEADLINE_S).outcomes[0]
            out.append((o.reply, o.latency_s))
            done()
        return out


def _report(driven: Driven, done: Callable[[Outcome], None]) -> None:
    for o in driven.outcomes:
        if o.done_s is not None:
            done(o)


def simulated_testbed(cfg: BenchConfig, setup: SimSetup) -> Testbed:
    """cfg's contenders as simulated engines; continuous batching at the largest batch size is the reference."""
    batch = max((c.max_batch_size for c in cfg.contenders), default=8)
    source = f"{setup.source}; every engine charged it" + (f" with noise {setup.noise:g}" if setup.noise else "")
    makers = Makers([contender_maker(c) for c in cfg.contenders],
                    contender_maker(Contender("continuous", max_batch_size=batch)), setup.latency, source)
    meta = setup.latency.metadata
    described = Described(f"simulated engine, {setup.source}", model_for(setup.latency).name,
                          f"simulated ({meta.get('device') or 'profiled device'})", str(meta.get("dtype") or "n/a"),
                          "latency model")
    return Testbed(SimulatedDriver(setup), makers, SIMULATED, described, Startup(model_load_s=None))


def run_simulation(cfg: BenchConfig, setup: SimSetup) -> BenchRun:
    """bench.app.run_bench on simulated engines; the same BenchRun, for bench.app.write_outputs."""
    return asyncio.run(run_bench(cfg, simulated_testbed(cfg, setup)))
