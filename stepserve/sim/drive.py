"""Drive an EngineCore with the bench's loads on a simulated clock, and record what the bench's load generator
would have seen (bench.load.Outcome, bench.targets.StepSample), so the bench's own metrics apply unchanged.

Open loop: every request arrives at its trace offset. Closed loop: each user sends its next request the moment
the previous answer is back (a refused one: REFUSED_RETRY_S later, so a full queue cannot spin at one instant).
At `stop_at` (the end of the run plus the drain) the bench cancels what is still out; here the clock simply
stops there, and an answer that would have come later counts as unfinished, as it does in the bench.

Times are seconds on the simulated clock, which starts at 0 = the start of the run: nothing here reads the wall
clock or sleeps, and iteration is in arrival order, so the same inputs give the same outcomes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from ..bench.load import Outcome
from ..bench.targets import FAILED, REJECTED, UNFINISHED, Reply, StepSample, reply_of
from ..bench.workload import RequestSpec, Trace
from ..engine.core import EngineCore
from ..request.types import Request, StepReport
from ..request.validation import ValidationError
from .loop import ReplicaLost, SimLoop

REFUSED_RETRY_S = 0.001  # closed loop: a user whose request was refused (or invalid) sends again this much later


@dataclass
class Driven:
    outcomes: list[Outcome]  # open loop: trace order; closed loop: send order
    samples: list[StepSample] = field(default_factory=list)  # engine steps that ran the executor
    end_time: float = 0.0  # simulated time the run stopped
    loop: SimLoop | None = None
    lost_failed: int = 0  # requests that failed because their replica was lost


def drive_open(core: EngineCore | list[EngineCore], trace: Trace, warmup_s: float, stop_at: float,
               fleet=None) -> Driven:
    """The bench's open loop (run_open_loop) on simulated time; `core` a list of replicas behind `fleet`
    (sim.fleet.Fleet) for a fleet."""
    outcomes = [Outcome(i, item.spec, item.offset_s, sent_s=item.offset_s, warmup=item.offset_s < warmup_s)
                for i, item in enumerate(trace.items)]
    return _drive(core, outcomes, None, 0.0, warmup_s, stop_at, fleet)


def drive_closed(core: EngineCore | list[EngineCore], users: list[Iterator[RequestSpec]], warmup_s: float,
                 end_s: float, stop_at: float, fleet=None) -> Driven:
    """The bench's closed loop (run_closed_loop) on simulated time: every user sends at 0, then on each answer
    until `end_s`."""
    first = [Outcome(u, next(requests), 0.0, sent_s=0.0, warmup=warmup_s > 0) for u, requests in enumerate(users)]
    driven = _drive(core, first, users, end_s, warmup_s, stop_at, fleet)
    driven.outcomes.sort(key=lambda o: (o.scheduled_s, o.index))
    return driven


def _drive(core, outcomes: list[Outcome], users: list[Iterator[RequestSpec]] | None, end_s: float,
           warmup_s: float, stop_at: float, fleet=None) -> Driven:
    """Both loads on the simulated clock's loop. `users` None: open loop (outcomes are the whole trace).
    Otherwise outcome i of the first list belongs to user i, and each answer before `end_s` makes that user's
    next outcome. With a fleet, a request's adapter is the fleet's to model (it is not sent to the engine)."""
    loop = SimLoop(core if isinstance(core, list) else [core], fleet, stop_at=stop_at)
    if fleet is not None:
        fleet.until = max([o.scheduled_s for o in outcomes] + [end_s])
    driven = Driven(list(outcomes), loop=loop)
    out: dict[int, Outcome] = {}
    owner: dict[int, int] = {}

    def send(o: Outcome, user: int | None = None) -> None:
        out[o.index] = o
        if user is not None:
            owner[o.index] = user
        params, adapter = o.spec.to_params(), None
        if fleet is not None and params.loras:
            adapter, params.loras = str(params.loras[0]["name"]), None
        loop.arrive(o.scheduled_s, params, o.index, adapter, o.spec.model)

    def ended(key: int, done: float, request: Request | None, error: Exception | None) -> None:
        o = out.pop(key)
        o.reply, o.done_s = _reply(request, error), done
        if isinstance(error, ReplicaLost):
            driven.lost_failed += 1
        if users is None:
            return
        user = owner.pop(key)
        refused = o.reply.status in (REJECTED, FAILED) and done <= o.sent_s
        nxt = done + (REFUSED_RETRY_S if refused else 0.0)
        if nxt < end_s:
            new = Outcome(len(driven.outcomes), next(users[user]), nxt, sent_s=nxt, warmup=nxt < warmup_s)
            driven.outcomes.append(new)
            send(new, user)

    def stepped(_: int, t: float, report: StepReport) -> None:
        if report.duration_s > 0:
            driven.samples.append(StepSample(t, report.duration_s, report.batch_size))

    for o in outcomes:
        send(o, o.index if users is not None else None)
    loop.run(ended, stepped)
    driven.end_time = loop.end_time
    for o in driven.outcomes:  # still out at the stop: the bench counts these as unfinished
        if o.done_s is None:
            o.reply = Reply(UNFINISHED)
    return driven


def _reply(request: Request | None, error: Exception | None) -> Reply:
    if request is not None:
        return reply_of(request)
    if isinstance(error, ValidationError):
        return Reply(FAILED, error=str(error), reason="invalid_request")
    if isinstance(error, (ReplicaLost, RuntimeError)):  # its replica was lost; or its caller went away first
        return Reply(FAILED, error=str(error), reason="replica_failed" if isinstance(error, ReplicaLost) else
                     "cancelled")
    return Reply(REJECTED, error=str(error), reason=type(error).__name__)
