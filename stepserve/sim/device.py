"""Several models on one simulated replica: one engine core (and policy) per model, one device that runs one step
at a time, and the device policy the live server runs (scheduling.device_share.DeviceShare) choosing which
model's engine steps next.

The simulated clock's loop (sim.loop) gives a replica a `Models` in place of a single EngineCore. At each of the
replica's turns, every engine that is ready (it has work, and its step or policy wake-up is due) bids as the live
engine thread does before each step: its most urgent deadline (core.earliest_deadline()), the predicted time of
its next step (its latency model at the batch it holds), and since when it has waited for the device (the end of
its own last step, the arrival that woke it, or its policy's wake-up). The chosen engine steps; the step's
reported duration is charged to its model. An engine whose policy chooses to wait (an idle step) steps again at
its wake-up and does not hold the device: the others bid on at once, so the device never idles while a step is
ready. A single model needs no choice, so a replica of one model steps exactly as a lone engine does.

What each model got is kept (`ModelUse`): steps, device seconds, and the longest a step waited for the device, so
a run can check the device policy's promise (no step waits longer than its aging bound plus one step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..engine.core import EngineCore
from ..fleet.stats import ReplicaStats, core_stats
from ..request.types import StepReport
from ..scheduling.device_share import DeviceShare, EngineBid, plan_at

INF = math.inf


class UnknownModel(ValueError):
    """A request names a model its replica does not hold: an error in the simulator's input."""


@dataclass
class ModelUse:
    """What one model got of its replica's device."""

    steps: int = 0  # steps that ran the executor
    busy_s: float = 0.0  # device seconds of those steps
    max_wait_s: float = 0.0  # the longest a step waited for the device after its engine was ready
    max_step_s: float = 0.0  # the longest of its steps


class Models:
    """The engines of the models one replica holds, by name (the first: the default, for requests that name none),
    sharing one device under `share` (weights per model, aging)."""

    def __init__(self, cores: Mapping[str, EngineCore], share: DeviceShare | None = None,
                 plan_shares: bool = True) -> None:
        if not cores:
            raise ValueError("a replica needs at least one model")
        self.cores = dict(cores)
        self.default = next(iter(self.cores))
        self.share = share if share is not None else DeviceShare()
        self.plan_shares = plan_shares  # as the live server: slo plans at its share (False: at the whole device)
        self.ready = dict.fromkeys(self.cores, INF)  # when each engine began to wait for the device (INF: it does not)
        self.use = {m: ModelUse() for m in self.cores}
        self.last: str | None = None  # the model of the last step (for an on_step reader)
        self._latency: dict[str, object] = {}

    @property
    def core(self) -> EngineCore:
        """The default model's engine (what a reader of one engine per replica sees)."""
        return self.cores[self.default]

    def name_of(self, model: str | None) -> str:
        """The model a request naming `model` goes to (None: the default); UnknownModel if it is not held here."""
        if model is None:
            return self.default
        if model not in self.cores:
            raise UnknownModel(f"a request names model {model!r}, which this replica does not hold; it holds: "
                               f"{', '.join(self.cores)}")
        return model

    def has_work(self) -> bool:
        return any(c.has_work() for c in self.cores.values())

    def wake(self, model: str, t: float) -> None:
        """Engine `model` has something new to do at t (an arrival, an abort, a refusal to report)."""
        if t < self.ready[model]:
            self.ready[model] = t

    def next_wake(self) -> float:
        return min(self.ready.values())

    def pick(self, t: float, tried: set[str]) -> str | None:
        """The model whose engine steps at t (None: no engine is ready). `tried`: engines that already took an
        idle step at t (their policy chose to wait), left out."""
        bids = []
        for m, core in self.cores.items():
            if self.ready[m] <= t and m not in tried:
                if core.has_work():
                    bids.append(m)
                else:
                    self.ready[m] = INF  # nothing to do until something arrives
        if not bids:
            return None
        if len(bids) == 1 and not self.plan_shares:
            return bids[0]
        chosen = self.share.pick([EngineBid(m, self.ready[m], self.cores[m].earliest_deadline(), self.work_s(m))
                                  for m in bids], t)
        return chosen.model

    def step(self, model: str, t: float) -> StepReport:
        """Engine `model` steps at t; its device time is charged, and it is ready again at the step's end (or at
        its policy's wake-up, if it chose to wait)."""
        core = self.cores[model]
        if self.plan_shares and len(self.cores) > 1:  # as the live engine thread: slo plans at the share of the device it gets now
            plan_at(core.policy, self.share.share_now(model, [m for m, c in self.cores.items() if c.has_work()], t))
        report = core.step(t)
        self.last = model
        d = report.duration_s
        if d > 0:
            use = self.use[model]
            use.steps += 1
            use.busy_s += d
            use.max_wait_s = max(use.max_wait_s, t - self.ready[model])
            use.max_step_s = max(use.max_step_s, d)
            self.share.charge(model, d)
            self.ready[model] = t + d
        elif not report.finished:  # idle: until its policy's wake-up, or an arrival
            self.ready[model] = INF if report.wake_at is None else max(report.wake_at, t)
        return report

    def stats(self, t: float, model: str | None, adapters=frozenset()) -> ReplicaStats:
        """The replica as a router placing a request for `model` sees it: that model's engine (the batch the
        request would join, its step curve; fleet.stats.core_stats, each engine priced by its own latency model),
        with the work in hand of every model on the device, and the other models' work counted whole in the
        request's fixed seconds: it shares the device with that work (a pessimistic bound: under the device
        policy the two interleave)."""
        parts = {m: core_stats(c, t, self.latency(m), None, adapters) for m, c in self.cores.items()}
        own = parts[self.name_of(model)]
        total = sum(p.work_s for p in parts.values())
        return replace(own, work_s=total, fixed_s=own.fixed_s + total - own.work_s,
                       slack_s=min(p.slack_s - (total - p.work_s) for p in parts.values()),
                       jobs=sum(p.jobs for p in parts.values()))

    def latency(self, model: str):
        """The latency model engine `model` charges (its fake executor's)."""
        latency = self._latency.get(model)
        if latency is None:
            latency = self._latency[model] = latency_of(self.cores[model])
        return latency

    def work_s(self, model: str) -> float:
        """The predicted time of the engine's next step: its latency model at the batch it runs (what it runs
        now, else what waits, up to its policy's batch size)."""
        core = self.cores[model]
        batch = core.running or list(_first(core.waiting, core.policy.max_batch_size))
        if not batch:
            return 0.0
        return self.latency(model).step_s(len(batch), batch[0].bucket)


def latency_of(core: EngineCore):
    """The latency model a simulated engine charges (its executor's), else the fake cost model's as one."""
    cost = core.executor.cost
    if hasattr(cost, "latency"):
        return cost.latency
    from ..costs import LatencyModel

    return LatencyModel.from_cost_model(cost)


def _first(queue, k: int):
    for i, r in enumerate(queue):
        if i >= k:
            return
        yield r
