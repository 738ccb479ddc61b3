"""One contender of `stepserve simulate --replicas N` as a fleet: N engines of the contender behind a router on one
simulated clock (sim.fleet.Fleet), optionally autoscaled (sim.autoscale) and with replicas lost on purpose; and
what the fleet did, for results.json (`FleetReport`): replica-seconds, replicas over time, lost replicas,
adapter loads, and each replica's work in hand over time (the replica load plot).

A replica holds the devices its latency model was measured at (stepserve.costs.degree: a model of `--ulysses-degree
2` is a replica of two devices stepping with the degree-2 curve), so device-seconds are replica-seconds times
that."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..costs.degree import devices_of
from ..engine.core import EngineCore
from ..fleet.autoscale import DEFAULT_UTILISATION, SLOScaling
from ..fleet.routers import PLANNING_ROUTER, make_router
from .autoscale import Autoscaler, RayDefault
from .fleet import Fleet

DEFAULT_STARTUP_S = 30.0
LOAD_SAMPLES = 200  # work-in-hand samples per replica over a run (the replica load plot)


@dataclass
class FleetSettings:
    replicas: int = 1
    router: str = PLANNING_ROUTER
    autoscale: tuple[int, int] | None = None
    policy: str = "slo"  # slo | ray
    target_ongoing_requests: float = 2.0
    utilisation: float = DEFAULT_UTILISATION  # the slo policy's (fleet/autoscale.py)
    startup_s: float | None = None  # None: the latency model's load_s, else DEFAULT_STARTUP_S
    publish_every_s: float = 0.0
    adapter_load_s: float = 0.0
    failures: list[tuple[int, float]] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.replicas > 1 or self.autoscale is not None or bool(self.failures)

    def describe(self, devices: int = 1) -> str:
        """`devices`: what one replica holds (its latency model's degree)."""
        held = f" of {devices} devices each" if devices > 1 else ""
        text = f"{self.replicas} replicas{held} behind {self.router}"
        if self.autoscale:
            text += f", autoscaling {self.autoscale[0]}-{self.autoscale[1]} ({self.policy} policy)"
        return text


@dataclass
class FleetReport:
    """What the fleet did in one run (results.json, `fleet` of each run)."""

    replicas: int
    router: str
    autoscale: str | None
    replica_s: float = 0.0
    replicas_over_time: list[tuple[float, int]] = field(default_factory=list)
    lost_replicas: list[int] = field(default_factory=list)
    failed_on_lost: int = 0  # requests that failed because their replica was lost
    adapter_loads: int = 0
    publish_every_s: float = 0.0
    load_t_s: list[float] = field(default_factory=list)  # sample times
    load_work_s: list[list[float | None]] = field(default_factory=list)  # per replica: work in hand (None: not up)
    devices_per_replica: int = 1  # the latency model's parallel degree
    device_s: float = 0.0  # replica_s x devices_per_replica


def build_fleet(settings: FleetSettings, latency, make_core: Callable[[int], EngineCore], slo_s: float | None,
                seed: int, horizon_s: float) -> tuple[list[EngineCore], Fleet, FleetReport]:
    """The engines to start with, the Fleet that places requests on them, and the report it fills in."""
    startup = settings.startup_s
    if startup is None:
        startup = float(latency.metadata.get("load_s") or DEFAULT_STARTUP_S)
    scaler = None
    if settings.autoscale is not None:
        low, high = settings.autoscale
        if settings.policy == "ray":
            policy = RayDefault(settings.target_ongoing_requests, low, high)
        else:
            if slo_s is None:
                raise ValueError("--autoscale-policy slo needs the run's SLO (--slo-p95-ms, or the idle-latency rule)")
            policy = SLOScaling(slo_s, low, high, startup, utilisation=settings.utilisation)
        scaler = Autoscaler(policy, make_core, startup)
    fleet = Fleet(make_router(settings.router, seed, settings.adapter_load_s), latency, settings.publish_every_s,
                  settings.adapter_load_s, autoscaler=scaler)
    for r, t in settings.failures:
        fleet.once(t, lambda now, r=r: fleet.fail(r, now) if r < len(fleet.loop.reps) else None)
    autoscale = None if settings.autoscale is None else (
        f"{settings.autoscale[0]}:{settings.autoscale[1]} {settings.policy}, start-up {startup:g} s")
    report = FleetReport(settings.replicas, settings.router, autoscale, publish_every_s=settings.publish_every_s,
                         devices_per_replica=devices_of(latency))
    every = max(horizon_s / LOAD_SAMPLES, 1e-3)

    def sample(t: float) -> None:
        report.load_t_s.append(round(t, 4))
        for r in range(len(fleet.loop.reps)):
            while len(report.load_work_s) <= r:
                report.load_work_s.append([None] * (len(report.load_t_s) - 1))
            up = r in fleet.routable or fleet.loop.outstanding[r] > 0
            report.load_work_s[r].append(round(fleet.fresh(r, t).work_s, 4) if up else None)

    fleet.every(every, sample)
    return [make_core(r) for r in range(settings.replicas)], fleet, report


def finish_report(report: FleetReport, fleet: Fleet, end_time: float, failed_on_lost: int) -> FleetReport:
    scaler = fleet.autoscaler
    if scaler is not None:
        report.replica_s = round(scaler.total_replica_s(end_time), 3)
        report.replicas_over_time = list(scaler.counts)
    else:
        report.replica_s = round(len(fleet.loop.reps) * end_time, 3)
        report.replicas_over_time = [(0.0, len(fleet.loop.reps))]
    report.device_s = round(report.replica_s * report.devices_per_replica, 3)
    report.lost_replicas = sorted(fleet.loop.lost)
    report.failed_on_lost = failed_on_lost
    report.adapter_loads = fleet.adapter_loads
    return report
