"""Drive an EngineCore through a trace of arrivals on a simulated clock.

Time jumps: after each step the clock moves by the duration the executor reported; when the engine is idle it
jumps to the next arrival or to the policy's wake-up time, whichever comes first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..clock import SimClock
from ..engine import AdmissionError, EngineCore
from ..types import Request, SamplingParams, StepReport


@dataclass
class Arrival:
    time: float
    params: SamplingParams
    abort_at: float | None = None  # the caller goes away at this time


@dataclass
class SimulationResult:
    requests: list[Request]  # one per arrival, in arrival order (rejected ones included)
    steps: list[StepReport] = field(default_factory=list)
    end_time: float = 0.0


def simulate(
    core: EngineCore,
    arrivals: Sequence[Arrival],
    max_steps: int = 1_000_000,
    on_step: Callable[[StepReport], None] | None = None,
) -> SimulationResult:
    clock = SimClock(0.0)
    pending = sorted(arrivals, key=lambda a: a.time)
    aborts = sorted((a.abort_at, i) for i, a in enumerate(pending) if a.abort_at is not None)
    requests: list[Request | None] = [None] * len(pending)
    result = SimulationResult(requests=[])
    nxt = 0
    for _ in range(max_steps):
        now = clock.now()
        while nxt < len(pending) and pending[nxt].time <= now:
            try:
                requests[nxt] = core.add_request(pending[nxt].params, now)
            except AdmissionError as exc:
                requests[nxt] = exc.request
            nxt += 1
        while aborts and aborts[0][0] <= now:
            _, i = aborts.pop(0)
            if requests[i] is not None:  # abort_at before the arrival itself is ignored
                core.abort(requests[i].request_id)
        if not core.has_work() and nxt >= len(pending):
            break
        report = core.step(now)
        result.steps.append(report)
        if on_step is not None:
            on_step(report)
        clock.elapse(report.duration_s)
        if report.duration_s == 0 and not report.finished:
            # idle: jump to whatever can change the plan next
            candidates = [t for t in (report.wake_at,) if t is not None]
            if nxt < len(pending):
                candidates.append(pending[nxt].time)
            if aborts:
                candidates.append(aborts[0][0])
            if not candidates:
                if core.has_work():
                    raise RuntimeError("the engine is stuck: work is queued but nothing can make progress")
                break
            clock.sleep_until(max(min(candidates), now))
    else:
        raise RuntimeError(f"simulation did not finish within {max_steps} steps")
    result.requests = [r for r in requests if r is not None]
    result.end_time = clock.now()
    return result
