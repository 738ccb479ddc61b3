"""One engine through a list of arrivals on a simulated clock (the loop in sim.loop), keeping every request.

Time jumps: after each step the clock moves by the duration the executor reported; when the engine is idle it
jumps to the next arrival, abort or policy wake-up, whichever comes first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..engine.core import EngineCore
from ..request.types import Request, StepReport
from .device import Models
from .loop import Arrival, SimLoop


@dataclass
class SimulationResult:
    requests: list[Request]  # one per arrival, in arrival order (rejected ones included)
    steps: list[StepReport] = field(default_factory=list)
    end_time: float = 0.0


def simulate(
    core: EngineCore | Models,
    arrivals: Sequence[Arrival],
    max_steps: int = 1_000_000,
    on_step: Callable[[StepReport], None] | None = None,
) -> SimulationResult:
    """Run every arrival to its end. An invalid request raises its ValidationError. `core`: one engine, or the
    engines of several models sharing one device (sim.device.Models; each arrival goes to the model it names)."""
    pending = sorted(arrivals, key=lambda a: a.time)
    loop = SimLoop([core], max_events=max_steps + 2 * len(pending))
    for i, a in enumerate(pending):
        loop.arrive(a.time, a.params, i, model=a.model)
        if a.abort_at is not None:
            loop.abort(a.abort_at, i)
    requests: list[Request | None] = [None] * len(pending)
    result = SimulationResult(requests=[])

    def ended(key: int, t: float, request: Request | None, error: Exception | None) -> None:
        if request is None:
            raise error
        requests[key] = request

    def stepped(_: int, t: float, report: StepReport) -> None:
        result.steps.append(report)
        if on_step is not None:
            on_step(report)

    loop.run(ended, stepped)
    result.requests = [r for r in requests if r is not None]
    result.end_time = loop.end_time
    return result
