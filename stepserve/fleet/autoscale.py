"""How many replicas to run, from the fleet's predicted backlog against the SLO: one pure function (`decide`),
called by Ray Serve's custom autoscaling policy (server/ray/autoscale.py) and by the simulator (sim/autoscale.py).

A count of requests in flight (Ray Serve's target_ongoing_requests) means very different work for a 50-step
1024x1024 image and a 4-step thumbnail, and counts nothing for a video job running in the background. The
replicas' own predictions do: each publishes its seconds of work in hand (fleet/work.py, every request its
engine holds, video jobs included). The rule, at each call:

- Work arriving. A replica that has work drains one second of it per second, so the fleet's backlog B (the sum
  of the replicas' work in hand) changes by what arrives less what the busy replicas drain: the seconds of work
  arriving per second are A = (B - B_before + drained) / elapsed, smoothed over `trend_s`. Holding it needs
  ceil(A / `utilisation`) replicas (default 0.8: a replica busy 80% of the time). A counts what the requests
  will cost, not how many they are, and a video job in the background counts like any other work.
- Backlog. A request arriving now waits about B / n before its own steps on a fleet of n; the fleet holds the
  SLO while that stays within `up_frac` x the SLO (default half: the other half is the request's own service),
  so it needs ceil(B / (up_frac x SLO)) replicas.
- Up at once: when either count passes the replicas running and starting, the difference is started now (a
  replica takes `startup_s` to start: reacting to the work arriving rather than to a broken SLO is what gets
  them there in time).
- Slowly down: only when both counts, taken at HYSTERESIS (0.8) of the utilisation and backlog that up allows,
  stay below the replicas running for `down_delay_s` in a row (none starting), then to the larger of them.
  Never below MIN, never above MAX.
- Never one running a job. The replica to stop (`pick_to_stop`) is one that runs no background job (stats.jobs),
  the one with the least work; the caller drains it (no new requests; it stops when empty). Where the caller
  cannot choose (Ray Serve picks which replica stops), no replica is removed while any runs a job.

Pure: no clock (times are given), no I/O; the state between calls is a small dict the caller keeps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .stats import ReplicaStats

DEFAULT_UP_FRAC = 0.5
DEFAULT_UTILISATION = 0.8
DEFAULT_DOWN_DELAY_S = 60.0
DEFAULT_TREND_S = 15.0
HYSTERESIS = 0.8  # down asks for the counts at this fraction of the utilisation and backlog that up allows


@dataclass(frozen=True)
class SLOScaling:
    """The settings of the rule (module docstring)."""

    slo_s: float
    low: int = 1
    high: int = 1
    startup_s: float = 30.0
    up_frac: float = DEFAULT_UP_FRAC
    utilisation: float = DEFAULT_UTILISATION
    down_delay_s: float = DEFAULT_DOWN_DELAY_S
    trend_s: float = DEFAULT_TREND_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.slo_s) and self.slo_s > 0):
            raise ValueError(f"the SLO must be a number of seconds > 0, got {self.slo_s}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"autoscale bounds must be 1 <= MIN <= MAX, got {self.low}:{self.high}")
        if not 0 < self.up_frac <= 1 or not 0 < self.utilisation <= 1:
            raise ValueError(f"up_frac and utilisation must be in (0, 1], got {self.up_frac} and {self.utilisation}")
        if self.startup_s < 0 or self.down_delay_s < 0 or self.trend_s <= 0:
            raise ValueError("startup_s and down_delay_s must be >= 0 seconds, trend_s > 0")


def decide(stats: Sequence[ReplicaStats], starting: int, now: float, rule: SLOScaling, state: dict) -> int:
    """The number of replicas to run (running and starting together), given the stats of those running now.
    `state` is kept by the caller between calls (empty at first) and updated here."""
    have = len(stats) + starting
    backlog = sum(s.work_s for s in stats)
    rate = _arriving(stats, backlog, now, rule.trend_s, state)
    need = max(math.ceil(rate / rule.utilisation - 1e-9), math.ceil(backlog / (rule.up_frac * rule.slo_s) - 1e-9),
               rule.low)
    need = min(need, rule.high)
    if need > have:
        state.pop("low_since", None)
        return need
    # down: with a margin (HYSTERESIS) below what up asks for, so that the count does not swing at the edge
    fewer = max(math.ceil(rate / (rule.utilisation * HYSTERESIS) - 1e-9),
                math.ceil(backlog / (rule.up_frac * HYSTERESIS * rule.slo_s) - 1e-9), rule.low)
    if fewer < have and starting == 0:
        since = state.setdefault("low_since", now)
        if now - since >= rule.down_delay_s:
            state.pop("low_since", None)
            return fewer
    else:
        state.pop("low_since", None)
    return min(max(have, rule.low), rule.high)


def _arriving(stats: Sequence[ReplicaStats], backlog: float, now: float, trend_s: float, state: dict) -> float:
    """Seconds of work arriving per second, smoothed exponentially over about trend_s (module docstring)."""
    last = state.get("last")
    state["last"] = (now, backlog, [s.work_s for s in stats])
    if last is None or now <= last[0]:
        return state.get("rate", 0.0)
    elapsed = now - last[0]
    drained = sum(min(w, elapsed) for w in last[2])
    rate = max((backlog - last[1] + drained) / elapsed, 0.0)
    weight = 1.0 - math.exp(-elapsed / trend_s)
    state["rate"] = state.get("rate", rate) + weight * (rate - state.get("rate", rate))
    return state["rate"]


def pick_to_stop(stats: Sequence[ReplicaStats]) -> int | None:
    """The replica to drain: one running no background job, the least work first (None: every one runs a job)."""
    free = [i for i, s in enumerate(stats) if s.jobs == 0]
    if not free:
        return None
    return min(free, key=lambda i: (stats[i].work_s, stats[i].outstanding, i))
