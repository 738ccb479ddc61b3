"""The device share's fairness, measured on the simulated clock: two models on one device under a load that
saturates it, each half the requests, deadlines on one of them only (the "deadline model"; the other is the
"batch model"), against each model served alone at its share of the device.

"Alone at its share" is the processor-sharing yardstick (a model entitled to a share s of the device is promised
at least the service of a device of its own s times as fast): the same model's requests of the same trace, on a
device whose every stage (encode, step, decode) takes 1/s as long. The device policy (scheduling.device_share)
passes when, on the same seeded trace,

- the deadline model's attainment (requests completed by their deadline, over all it was sent) is at most 5
  points below its attainment alone at its share;
- the batch model's throughput is at least 0.9 of its share's: the requests it completed by the end of the
  arrivals, over what it completed alone at its share in that time (the batch model is sent more than its share
  can serve, so both are counts of a backlogged model);
- no step waited for the device longer than the aging bound plus the longest step (sim.device.ModelUse).

With the slo strategy, each model's policy plans at the share of the device it gets now (its weight over those of
the models with work: scheduling.device_share.plan_at), as the live engine thread has it do; `plan_shares=False`
plans at the whole device's speed instead, which admits what the share cannot finish and misses where the model
is sent its share or more (docs/BENCHMARKS.md, "Several models on one device", has both measured).

Pure simulation: nothing reads the wall clock, and the same case gives the same numbers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..costs import FakeExecutor, LatencyModel
from ..costs.latency_model import Curve
from ..engine.config import EngineOptions
from ..request.types import RequestStatus, SamplingParams
from ..scheduling.device_share import DEFAULT_AGING_S, DEFAULT_BORROW_S, DeviceShare, share_of
from .device import Models
from .loop import Arrival
from .run import simulate

DEADLINE, BATCH = "deadline", "batch"  # the two models' names


@dataclass
class FairnessCase:
    """Two models on one device. `load`: the offered device time per second (1 = the device at full batches
    all the time); `timeout_s`: the deadline of every request of the deadline model."""

    deadline_latency: LatencyModel
    batch_latency: LatencyModel
    load: float = 1.3
    timeout_s: float = 3.0
    deadline_steps: int = 8
    batch_steps: int = 20
    weights: dict[str, float] = field(default_factory=lambda: {DEADLINE: 1.0, BATCH: 1.0})
    duration_s: float = 120.0
    seed: int = 0
    strategy: str = "continuous"
    max_batch_size: int = 8
    aging_s: float = DEFAULT_AGING_S
    borrow_s: float = DEFAULT_BORROW_S
    # slo on the shared device plans at the share its model can count on now (scheduling/device_share.plan_at), as
    # live; False: at the whole device's speed (the comparison docs/BENCHMARKS.md measures)
    plan_shares: bool = True  # slo plans at the share of the device its model gets now (False: at the whole device)

    def request_s(self, model: str) -> float:
        """Device seconds one request of `model` costs at full batches (what `load` counts)."""
        latency, steps = ((self.deadline_latency, self.deadline_steps) if model == DEADLINE
                          else (self.batch_latency, self.batch_steps))
        b = self.max_batch_size
        return (steps * latency.step_s(b) + latency.encode_s(b) + latency.decode_s(b)) / b

    def arrivals(self) -> list[Arrival]:
        """Poisson arrivals at the rate that offers `load`, each request of either model with chance 1/2."""
        rate = self.load / (0.5 * self.request_s(DEADLINE) + 0.5 * self.request_s(BATCH))
        rng, t, out = random.Random(f"fairness-{self.seed}"), 0.0, []
        while True:
            t += rng.expovariate(rate)
            if t >= self.duration_s:
                return out
            model = DEADLINE if rng.random() < 0.5 else BATCH
            params = SamplingParams(prompt="a", seed=len(out), num_inference_steps=self.deadline_steps,
                                    timeout_s=self.timeout_s) if model == DEADLINE else SamplingParams(
                prompt="a", seed=len(out), num_inference_steps=self.batch_steps)
            out.append(Arrival(t, params, model=model))


@dataclass
class Fairness:
    shares: dict[str, float]
    attainment_shared: float  # the deadline model's, on the shared device
    attainment_alone: float  # the same requests alone at its share
    batch_done_shared: int  # the batch model's requests completed by the end of the arrivals, shared
    batch_done_alone: int  # ... alone at its share
    device_frac: dict[str, float]  # each model's device seconds over the arrivals' time
    max_wait_s: float  # the longest any step waited for the device
    max_step_s: float  # the longest step
    aging_s: float

    @property
    def attainment_gap(self) -> float:
        return self.attainment_alone - self.attainment_shared

    @property
    def batch_ratio(self) -> float:
        return self.batch_done_shared / self.batch_done_alone if self.batch_done_alone else float("nan")

    @property
    def wait_bound_s(self) -> float:
        return self.aging_s + self.max_step_s

    @property
    def passes(self) -> bool:
        return self.attainment_gap <= 0.05 and self.batch_ratio >= 0.9 and self.max_wait_s <= self.wait_bound_s


def slowed(latency: LatencyModel, factor: float) -> LatencyModel:
    """`latency` on a device `factor` times slower: every stage's seconds times `factor`."""
    def times(curve: Curve) -> Curve:
        return Curve(tuple((n, s * factor) for n, s in curve.points))

    return LatencyModel(step={b: times(c) for b, c in latency.step.items()}, encode=times(latency.encode),
                        decode={b: times(c) for b, c in latency.decode.items()},
                        reference_bucket=latency.reference_bucket, metadata=dict(latency.metadata))


def measure(case: FairnessCase) -> Fairness:
    """The case's trace on the shared device, and each model's half of it alone at its share."""
    arrivals = case.arrivals()
    options = EngineOptions(strategy=case.strategy, max_batch_size=case.max_batch_size)
    latencies = {DEADLINE: case.deadline_latency, BATCH: case.batch_latency}
    shares = share_of(case.weights, [DEADLINE, BATCH])

    def core(model: str, factor: float = 1.0):
        """An engine of `model` on a device `factor` times slower."""
        latency = slowed(latencies[model], factor) if factor != 1.0 else latencies[model]
        if case.strategy != "slo":
            return options.make_core(FakeExecutor.charging(latency))
        return EngineOptions(strategy="slo", max_batch_size=case.max_batch_size,
                             latency_model=latency).make_core(FakeExecutor.charging(latency))

    models = Models({m: core(m) for m in (DEADLINE, BATCH)},
                    DeviceShare(case.weights, aging_s=case.aging_s, borrow_s=case.borrow_s),
                    plan_shares=case.plan_shares)
    busy = dict.fromkeys(models.cores, 0.0)  # device seconds of each model while arrivals came

    def stepped(report) -> None:
        if report.now < case.duration_s:
            busy[models.last] += min(report.duration_s, case.duration_s - report.now)

    shared = simulate(models, arrivals, on_step=stepped).requests
    alone = {m: simulate(core(m, 1.0 / shares[m]), [a for a in arrivals if a.model == m]).requests
             for m in (DEADLINE, BATCH)}
    mine = [r for r, a in zip(shared, arrivals) if a.model == DEADLINE]  # both in arrival order
    return Fairness(
        shares=shares,
        attainment_shared=_on_time(mine),
        attainment_alone=_on_time(alone[DEADLINE]),
        batch_done_shared=_done_by(shared, arrivals, case.duration_s),
        batch_done_alone=sum(1 for r in alone[BATCH] if _completed(r) and r.timing.finished <= case.duration_s),
        device_frac={m: s / case.duration_s for m, s in busy.items()},
        max_wait_s=max(u.max_wait_s for u in models.use.values()),
        max_step_s=max(u.max_step_s for u in models.use.values()),
        aging_s=case.aging_s,
    )


def _completed(r) -> bool:
    return r.status is RequestStatus.COMPLETED


def _on_time(requests) -> float:
    """Completed by the deadline (a late image is not an answer: the engine fails it), over all sent."""
    return sum(1 for r in requests if _completed(r)) / len(requests) if requests else float("nan")


def _done_by(shared, arrivals, until: float) -> int:
    """The batch model's requests completed by `until` (`shared` in arrival order, as `arrivals` are made)."""
    return sum(1 for r, a in zip(shared, arrivals) if a.model == BATCH and _completed(r) and r.timing.finished <= until)
