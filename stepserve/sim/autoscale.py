"""Autoscaling on the simulated clock: replicas started (after a start-up time) and drained as a policy says.

Two policies:
- `slo`: the fleet's own rule (fleet/autoscale.py: the predicted backlog against the SLO), called with the
  replicas' stats every `period_s`, as Ray Serve calls our custom policy.
- `ray`: a model of Ray Serve's default policy (ray.serve.autoscaling_policy, 2.60): the requests in flight,
  summed over the replicas, recorded every look_back x 0.2 s (6 s), pushed to the controller every 10 s and
  averaged over look_back_period_s (30 s); desired = that average / target_ongoing_requests, rounded up; a change
  up is made once it has been wanted for upscale_delay_s (30 s) in a row, down after downscale_delay_s (600 s).

A replica that starts is paid for from then on (replica-seconds) and takes requests after `startup_s`. One that
is stopped takes no more requests, finishes what it holds, and is paid for until then; the policy never stops
one that runs a background job (sim replicas run none). `replica_s` is the total paid.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.core import EngineCore
from ..fleet.autoscale import SLOScaling, decide, pick_to_stop

POLICIES = ("slo", "ray")
RAY_LOOK_BACK_S, RAY_RECORD_S, RAY_PUSH_S = 30.0, 6.0, 10.0
RAY_UPSCALE_DELAY_S, RAY_DOWNSCALE_DELAY_S = 30.0, 600.0


@dataclass
class RayDefault:
    """Ray Serve's default autoscaling policy, as modelled here (module docstring)."""

    target_ongoing_requests: float
    low: int = 1
    high: int = 1
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time, requests in flight)
    wanted: tuple[int, float] | None = None  # (direction, since when) of a change not yet made

    def record(self, t: float, in_flight: float) -> None:
        self.samples.append((t, in_flight))

    def decide(self, running: int, target: int, t: float) -> int:
        pushed = math.floor(t / RAY_PUSH_S) * RAY_PUSH_S  # what the controller has seen
        window = [v for at, v in self.samples if pushed - RAY_LOOK_BACK_S < at <= pushed]
        self.samples = [(at, v) for at, v in self.samples if at > pushed - RAY_LOOK_BACK_S]
        if not window or running == 0:
            return target
        desired = sum(window) / len(window) / self.target_ongoing_requests
        scaled = math.ceil(desired)
        if math.ceil(desired) < running and scaled == running:
            scaled -= 1
        scaled = min(max(scaled, self.low), self.high)
        if scaled == target:
            self.wanted = None
            return target
        direction = 1 if scaled > target else -1
        if self.wanted is None or self.wanted[0] != direction:
            self.wanted = (direction, t)
        delay = RAY_UPSCALE_DELAY_S if direction > 0 else RAY_DOWNSCALE_DELAY_S
        if t - self.wanted[1] + 1e-6 >= delay:
            self.wanted = None
            return scaled
        return target


class Autoscaler:
    """Starts and drains the replicas of a sim.fleet.Fleet on its loop, every `period_s`, as `policy` says."""

    def __init__(self, policy: SLOScaling | RayDefault, make_core: Callable[[int], EngineCore], startup_s: float,
                 period_s: float = 1.0) -> None:
        self.policy, self.make_core, self.startup_s, self.period_s = policy, make_core, startup_s, period_s
        self.fleet = None
        self.state: dict = {}
        self.starting: dict[int, float] = {}  # replica -> when it becomes routable
        self.draining: set[int] = set()
        self.paid_from: dict[int, float] = {}  # replica -> when it started (paid from)
        self.replica_s = 0.0  # of replicas already stopped
        self.counts: list[tuple[float, int]] = []  # (time, replicas paid for) at every change

    def attach(self, fleet) -> None:
        self.fleet = fleet
        for r in fleet.routable:
            self.paid_from[r] = 0.0
        self.counts.append((0.0, len(self.paid_from)))
        fleet.every(self.period_s, self.tick)
        if isinstance(self.policy, RayDefault):
            fleet.every(RAY_RECORD_S, lambda t: self.policy.record(t, sum(fleet.loop.outstanding)))

    def tick(self, t: float) -> None:
        fleet, loop = self.fleet, self.fleet.loop
        for r, up_at in list(self.starting.items()):
            if up_at <= t:
                del self.starting[r]
                fleet.joined(r)
        for r in list(self.draining):
            if loop.outstanding[r] == 0:
                self._stop(r, t)
        serving = list(fleet.routable)
        if isinstance(self.policy, RayDefault):
            want = self.policy.decide(len(serving), len(serving) + len(self.starting), t)
        else:
            want = decide([fleet.fresh(r, t) for r in serving], len(self.starting), t, self.policy, self.state)
        have = len(serving) + len(self.starting)
        for _ in range(want - have):
            r = loop.add_replica(self.make_core(len(loop.reps)))
            fleet.grew(r)
            self.starting[r] = t + self.startup_s
            self.paid_from[r] = t
        for _ in range(have - want):
            if self.starting:  # not serving yet: cancel the newest start
                r = max(self.starting)
                del self.starting[r]
                self._stop(r, t)
                continue
            pick = pick_to_stop([fleet.fresh(r, t) for r in serving])
            if pick is None or len(serving) <= 1:
                break
            r = serving.pop(pick)
            fleet.leave(r)
            self.draining.add(r)
            if loop.outstanding[r] == 0:
                self._stop(r, t)
        self._count(t)

    def _stop(self, r: int, t: float) -> None:
        self.draining.discard(r)
        self.replica_s += t - self.paid_from.pop(r)
        self._count(t)

    def _count(self, t: float) -> None:
        n = len(self.paid_from)
        if not self.counts or self.counts[-1][1] != n:
            self.counts.append((t, n))

    def total_replica_s(self, end: float) -> float:
        """Replica-seconds paid up to `end`: those stopped, plus those still running until then."""
        return self.replica_s + sum(end - t0 for t0 in self.paid_from.values())
