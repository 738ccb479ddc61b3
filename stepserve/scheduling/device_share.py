"""Which model's engine runs the next step on a device that several models share: a pure policy.

Each model served on one device has its own engine core and batching policy (its own buckets, cost curve and
deadlines); the device runs one step at a time. When more than one engine has a step ready, DeviceShare.pick
chooses, from what each engine bids (EngineBid: its most urgent deadline, the predicted time of its step, since
when it has waited for the device) and the device time each model has used, in this order:

1. Aging: a bid that has waited `aging_s` or more goes first (the longest waiting one), so no model starves, and
   no step waits for the device longer than aging_s plus the step running when its wait ran out.
2. Shares: each model is entitled to device time in proportion to its weight (weights from the configuration, 1 by
   default). A model that has used more than its share by more than `borrow_s` of device time runs only when no
   model within its share bids (the device never idles while work waits: work-conserving).
3. Earliest deadline first among the models within their shares, by slack: a bid's most urgent deadline minus the
   predicted time of its step. A bid without a deadline ranks after every bid with one.
4. Then the least used share (used device time over weight), then the longest waiting bid.

Device time is virtual time as in start-time fair queuing (Goyal, Vin and Cheng, SIGCOMM 1996): `charge` adds a
step's reported duration, over its weight, to its model; a model that comes back after an idle spell resumes at the
least used share among the bidders less a credit of borrow_s (as Linux CFS credits a task that wakes: a short
request of a model of short steps then runs whole instead of waiting behind another model's long step halfway), so
time it did not ask for is not banked against the others.

No clock: `now` and the step durations are given (the engine thread passes its clock's time and the executor's
report; the simulator passes its own), so the same policy runs live and simulated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_AGING_S = 2.0  # a bid that has waited this long goes first
DEFAULT_BORROW_S = 1.0  # device seconds a model may run ahead of its share for an earlier deadline


@dataclass(frozen=True)
class EngineBid:
    """One engine's claim on the device's next step."""

    model: str
    waiting_since: float  # when this engine began to wait for the device (clock units, the caller's clock)
    deadline: float | None = None  # the most urgent deadline of its live requests; None: none has one
    work_s: float = 0.0  # the predicted time of its next step (0: unknown)


@dataclass
class DeviceShare:
    """The device policy's state: device time used per model (virtual time), and the settings."""

    weights: Mapping[str, float] = field(default_factory=dict)  # model -> weight (absent: 1)
    aging_s: float = DEFAULT_AGING_S
    borrow_s: float = DEFAULT_BORROW_S
    used: dict[str, float] = field(default_factory=dict)  # model -> device seconds used / weight
    seen: dict[str, float] = field(default_factory=dict)  # model -> when it last bid

    def __post_init__(self) -> None:
        if not (self.aging_s > 0 and math.isfinite(self.aging_s)):
            raise ValueError(f"aging_s must be a positive number of seconds, got {self.aging_s!r}")
        if not (self.borrow_s >= 0 and math.isfinite(self.borrow_s)):
            raise ValueError(f"borrow_s must be a number of seconds >= 0, got {self.borrow_s!r}")
        for model, weight in self.weights.items():
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"the weight of model {model!r} must be a positive number, got {weight!r}")

    def weight(self, model: str) -> float:
        return float(self.weights.get(model, 1.0))

    def pick(self, bids: Sequence[EngineBid], now: float) -> EngineBid:
        """The bid whose engine runs the next step (see the module docstring). `bids` must not be empty."""
        if not bids:
            raise ValueError("pick needs at least one bid")
        self._join(bids, now)
        if len(bids) == 1:
            return bids[0]
        aged = [b for b in bids if now - b.waiting_since >= self.aging_s]
        if aged:
            return min(aged, key=lambda b: (b.waiting_since, b.model))
        floor = min(self.used[b.model] for b in bids)
        within = [b for b in bids if self.used[b.model] - floor <= self.borrow_s / self.weight(b.model)]
        return min(within, key=lambda b: (_slack(b), self.used[b.model], b.waiting_since, b.model))

    def charge(self, model: str, seconds: float) -> None:
        """A step of `model` took `seconds` of device time."""
        if seconds > 0 and math.isfinite(seconds):
            self.used[model] = self.used.get(model, 0.0) + seconds / self.weight(model)

    def _join(self, bids: Sequence[EngineBid], now: float) -> None:
        """A model new to the device, or back after bidding nothing for aging_s, starts no lower than the least
        used share of the models that kept bidding: it neither owes for their past nor claims time it did not ask
        for. (A model between two of its steps bids nothing for a moment: that is not an idle spell.)"""
        back = {b.model for b in bids if now - self.seen.get(b.model, -math.inf) > self.aging_s}
        kept = [self.used[m] for m, t in self.seen.items() if m not in back and now - t <= self.aging_s]
        floor = min(kept) if kept else min((self.used.get(m, 0.0) for m in back), default=0.0)
        for model in back:  # a returning model's credit: borrow_s (a short request then runs whole at once)
            self.used[model] = max(self.used.get(model, 0.0), floor - self.borrow_s / self.weight(model))
        for b in bids:
            self.seen[b.model] = now


    def share_now(self, model: str, active: Sequence[str], now: float) -> float:
        """The share of the device `model` can count on now: its weight over those of the models with work
        (`active`) or that bid within the last aging_s (a model between bursts comes back and takes its share:
        planning as if it had gone would admit what the share cannot finish). What its policy plans at (plan_at);
        a model alone gets the whole device."""
        models = set(active) | {model} | {m for m, t in self.seen.items() if now - t <= self.aging_s}
        return self.weight(model) / sum(self.weight(m) for m in models)


def plan_at(policy, share: float) -> None:
    """Tell a policy that predicts (slo: plan_share) the share of the device its model gets now; others ignore it."""
    plan = getattr(policy, "plan_share", None)
    if plan is not None:
        plan(share)


def _slack(bid: EngineBid) -> float:
    return math.inf if bid.deadline is None else bid.deadline - bid.work_s


def share_of(weights: Mapping[str, float], models: Sequence[str]) -> dict[str, float]:
    """Each model's share of the device when all of `models` bid all the time: weight over the weights' sum."""
    total = sum(float(weights.get(m, 1.0)) for m in models)
    return {m: float(weights.get(m, 1.0)) / total for m in models}
