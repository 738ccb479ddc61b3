"""Capacity planning over devices: how to spend D devices on one model, as R replicas of degree N (R x N <= D).

Splitting a request over N devices (stepserve.parallel: Ulysses, CFG, tensor parallel) cuts its latency but not in
proportion (communication, the parts not split), so N devices serve fewer requests a second as one replica of
degree N than as N replicas of one device. Which wins depends on the load and the SLO: at a low rate the split
replica answers sooner; near the devices' capacity only the replicas that waste nothing keep up.

Each degree has its own latency model (stepserve.costs.degree: `stepserve profile --ulysses-degree N`, or the
per-degree GPU curves of stepserve/models/latency). A split is simulated as the plan simulates replicas
(sim.plan.simulate_fleet): R engines behind the router, each charging the degree-N model, so each steps with the
degree-N curve. Pure functions of the spec and the seed: no clock, no devices.

- `cheapest`: at one rate, the split that holds the p95 SLO with the fewest devices (for each degree, the fewest
  replicas that hold it, found by sim.plan.plan_strategy's climb and bisection; then the degree whose R x N is
  least; a tie goes to the lower p95).
- `full_splits_table`: every split that uses all D devices (8x1, 4x2, 2x4, 1x8 for 8), p95 and goodput at each rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ..costs.degree import degree_label, devices_of
from ..costs.latency_model import LatencyModel
from ..util.words import plural
from .plan import PlanSpec, Probe, plan_strategy, simulate_fleet


@dataclass(frozen=True)
class Split:
    replicas: int
    degree: int  # devices per replica

    @property
    def devices(self) -> int:
        return self.replicas * self.degree

    @property
    def label(self) -> str:
        return f"{self.replicas}x{self.degree}"


@dataclass
class SplitProbe:
    """One split simulated at one rate, to the end (latencies in seconds; math.inf where too few completed)."""

    split: Split
    rate_rps: float
    probe: Probe

    @property
    def goodput_rps(self) -> float:
        """Requests a second completed within the SLO (the share of the offered ones, times the rate)."""
        return (self.probe.goodput_frac or 0.0) * self.rate_rps


@dataclass
class Choice:
    """The cheapest split at one rate; `split` None when no split of at most D devices holds the SLO."""

    rate_rps: float
    split: Split | None
    probe: Probe | None
    tried: dict[int, int | None]  # degree -> the fewest replicas that held (None: none up to D / degree did)


def by_degree(models: Sequence[LatencyModel]) -> dict[int, LatencyModel]:
    """Degree -> its model, from what each model's metadata says; two models of one degree raise ValueError."""
    out: dict[int, LatencyModel] = {}
    for m in models:
        n = devices_of(m)
        if n in out:
            raise ValueError(f"two latency models for {n} device(s) per replica ({degree_label(out[n])} and "
                             f"{degree_label(m)}); give one model per degree")
        out[n] = m
    return dict(sorted(out.items()))


def full_splits(devices: int, degrees: Sequence[int]) -> list[Split]:
    """The splits that use every device: D / N replicas of degree N, for each degree N that divides D; fewest
    devices per replica first."""
    return [Split(devices // n, n) for n in sorted(degrees) if n <= devices and devices % n == 0]


def simulate_split(base: PlanSpec, models: Mapping[int, LatencyModel], split: Split, rate_rps: float,
                   strategy: str) -> SplitProbe:
    """`split` at `rate_rps`: its replicas charge the degree's model; simulated to the end (exact p95)."""
    spec = replace(base, latency=models[split.degree], rate_rps=rate_rps)
    _, probe = simulate_fleet(spec, strategy, split.replicas, stop_early=False)
    return SplitProbe(split, rate_rps, probe)


def cheapest(base: PlanSpec, models: Mapping[int, LatencyModel], devices: int, rate_rps: float, strategy: str,
             on_probe: Callable[[Split, Probe], None] | None = None) -> Choice:
    """The split of at most `devices` devices that holds base's SLO at `rate_rps` with the fewest devices."""
    best: tuple[int, float, Split, Probe] | None = None
    tried: dict[int, int | None] = {}
    for degree, model in models.items():
        if degree > devices:
            continue
        spec = replace(base, latency=model, rate_rps=rate_rps, max_replicas=devices // degree)

        def probe(s: str, n: int, early: bool, spec=spec, degree=degree) -> Probe:
            p = simulate_fleet(spec, s, n, early)[1]
            if on_probe is not None:
                on_probe(Split(n, degree), p)
            return p

        plan = plan_strategy(spec, strategy, probe)
        tried[degree] = plan.replicas
        if plan.replicas is None:
            continue
        split, at = Split(plan.replicas, degree), plan.at(plan.replicas)
        key = (split.devices, at.p95_s)
        if best is None or key < best[:2]:
            best = (*key, split, at)
    if best is None:
        return Choice(rate_rps, None, None, tried)
    return Choice(rate_rps, best[2], best[3], tried)


# --- reporting -------------------------------------------------------------------------------------------------
def _seconds(s: float) -> str:
    return f"{s:.2f}" if math.isfinite(s) else "inf"


def full_splits_table(probes: Sequence[SplitProbe], slo_s: float) -> str:
    """One row per split and rate: devices per replica, p50 / p95 (s), whether p95 holds the SLO, goodput."""
    head = ("split", "per replica", "rate (req/s)", "p50 (s)", "p95 (s)", "SLO", "goodput (req/s)", "goodput")
    rows = []
    for sp in probes:
        p = sp.probe
        rows.append((sp.split.label, f"{sp.split.degree} device{'s' if sp.split.degree > 1 else ''}",
                     f"{sp.rate_rps:g}", _seconds(p.p50_s), _seconds(p.p95_s), "holds" if p.p95_s <= slo_s else "misses",
                     f"{sp.goodput_rps:.2f}", f"{(p.goodput_frac or 0.0):.1%}"))
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)])


def choice_line(c: Choice, devices: int, slo_s: float) -> str:
    """'at 0.8 req/s: 2x2 (4 of 8 devices), p95 3.10 s' or why none."""
    if c.split is None:
        return (f"at {c.rate_rps:g} req/s: no split of at most {plural(devices, 'device')} holds p95 <= {slo_s:g} s "
                f"(tried degrees {', '.join(map(str, c.tried)) or 'none'})")
    return (f"at {c.rate_rps:g} req/s: {c.split.label} ({c.split.replicas} replica{'s' if c.split.replicas > 1 else ''}"
            f" of {c.split.degree} device{'s' if c.split.degree > 1 else ''}, {c.split.devices} of {devices} "
            f"devices), p95 {_seconds(c.probe.p95_s)} s")


def to_json(probes: Sequence[SplitProbe], choices: Sequence[Choice], devices: int) -> dict:
    def probe(p: Probe) -> dict:
        fin = (lambda s: round(s, 4) if math.isfinite(s) else None)
        return {"p50_s": fin(p.p50_s), "p95_s": fin(p.p95_s), "p99_s": fin(p.p99_s), "held": p.held,
                "offered": p.offered, "completed": p.completed, "goodput_frac": p.goodput_frac}

    return {
        "devices": devices,
        "full_splits": [{"split": sp.split.label, "replicas": sp.split.replicas, "degree": sp.split.degree,
                         "rate_rps": sp.rate_rps, "goodput_rps": round(sp.goodput_rps, 4), **probe(sp.probe)}
                        for sp in probes],
        "cheapest": [{"rate_rps": c.rate_rps, "split": c.split.label if c.split else None,
                      "devices_used": c.split.devices if c.split else None,
                      "fewest_replicas_by_degree": {str(k): v for k, v in c.tried.items()},
                      **(probe(c.probe) if c.probe else {})} for c in choices],
    }
