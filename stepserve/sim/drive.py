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

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..bench.load import Outcome
from ..bench.targets import FAILED, OK, REJECTED, TIMEOUT, UNFINISHED, Reply, StepSample
from ..bench.workload import RequestSpec, Trace
from ..engine import AdmissionError, EngineCore
from ..types import FinishReason, Request, RequestStatus
from ..validation import ValidationError

REFUSED_RETRY_S = 0.001  # closed loop: a user whose request was refused (or invalid) sends again this much later
MAX_STEPS = 50_000_000  # a guard against a policy that never finishes


@dataclass
class Driven:
    outcomes: list[Outcome]  # open loop: trace order; closed loop: send order
    samples: list[StepSample] = field(default_factory=list)  # engine steps that ran the executor
    end_time: float = 0.0  # simulated time the run stopped


def reply_of(r: Request) -> Reply:
    """A finished request as EngineTarget would have answered it."""
    t = r.timing
    reason = getattr(r.finish_reason, "value", None)
    if r.status is RequestStatus.REJECTED:
        return Reply(REJECTED, error=r.error, reason=reason)
    if r.status is not RequestStatus.COMPLETED:
        status = TIMEOUT if r.finish_reason is FinishReason.TIMEOUT else FAILED
        return Reply(status, error=r.error or r.status.value, reason=reason)
    first = None if t.first_step_done is None else t.first_step_done - t.arrival
    return Reply(OK, queue_s=t.queue_s, first_step_s=first, denoise_s=t.denoise_s, decode_s=t.decode_s,
                 batch_sizes=list(t.batch_sizes))


def drive_open(core: EngineCore, trace: Trace, warmup_s: float, stop_at: float) -> Driven:
    """The bench's open loop (run_open_loop) on simulated time."""
    outcomes = [Outcome(i, item.spec, item.offset_s, sent_s=item.offset_s, warmup=item.offset_s < warmup_s)
                for i, item in enumerate(trace.items)]
    return _drive(core, outcomes, None, 0.0, warmup_s, stop_at)


def drive_closed(core: EngineCore, users: list[Iterator[RequestSpec]], warmup_s: float, end_s: float,
                 stop_at: float) -> Driven:
    """The bench's closed loop (run_closed_loop) on simulated time: every user sends at 0, then on each answer
    until `end_s`."""
    first = [Outcome(u, next(requests), 0.0, sent_s=0.0, warmup=warmup_s > 0) for u, requests in enumerate(users)]
    driven = _drive(core, first, users, end_s, warmup_s, stop_at)
    driven.outcomes.sort(key=lambda o: (o.scheduled_s, o.index))
    return driven


def _drive(core: EngineCore, outcomes: list[Outcome], users: list[Iterator[RequestSpec]] | None, end_s: float,
           warmup_s: float, stop_at: float) -> Driven:
    """One loop for both loads. `users` None: open loop (outcomes are the whole trace). Otherwise outcome i of the
    first list belongs to user i, and each answer before `end_s` makes that user's next outcome."""
    due: list[tuple[float, int, Outcome]] = [(o.scheduled_s, o.index, o) for o in outcomes]
    heapq.heapify(due)
    owner: dict[int, int] = {o.index: o.index for o in outcomes} if users is not None else {}
    live: dict[str, Outcome] = {}
    driven = Driven(list(outcomes))
    samples = driven.samples

    def answered(o: Outcome, done: float, reply: Reply) -> None:
        if done > stop_at:  # the bench would have cancelled it at the drain deadline
            return
        o.reply, o.done_s = reply, done
        if users is None:
            return
        user = owner.pop(o.index)
        nxt = done + (REFUSED_RETRY_S if reply.status in (REJECTED, FAILED) and done <= o.sent_s else 0.0)
        if nxt < end_s:
            new = Outcome(len(driven.outcomes), next(users[user]), nxt, sent_s=nxt, warmup=nxt < warmup_s)
            driven.outcomes.append(new)
            owner[new.index] = user
            heapq.heappush(due, (nxt, new.index, new))

    t = 0.0
    for _ in range(MAX_STEPS):
        while due and due[0][0] <= t:
            o = heapq.heappop(due)[2]
            try:
                live[core.add_request(o.spec.to_params(), t).request_id] = o
            except AdmissionError as exc:  # refused: reported as finished by the next step
                if exc.request is None:
                    answered(o, t, Reply(REJECTED, error=str(exc), reason=type(exc).__name__))
                else:
                    live[exc.request.request_id] = o
            except ValidationError as exc:
                answered(o, t, Reply(FAILED, error=str(exc), reason="invalid_request"))
        if t >= stop_at or (not due and not core.has_work()):
            break
        report = core.step(t)
        for r in report.finished:
            o = live.pop(r.request_id, None)
            if o is not None:
                answered(o, r.timing.finished, reply_of(r))
        if report.duration_s > 0:
            samples.append(StepSample(t, report.duration_s, report.batch_size))
            t += report.duration_s
        elif not report.finished:  # idle: jump to whatever can change the plan next
            nxt = [x for x in (report.wake_at, due[0][0] if due else None) if x is not None]
            if not nxt:
                if core.has_work():
                    raise RuntimeError("the engine is stuck: work is queued but nothing can make progress")
                break
            t = max(t, min(min(nxt), stop_at))
    else:
        raise RuntimeError(f"simulation did not finish within {MAX_STEPS} engine steps")
    driven.end_time = t
    for o in driven.outcomes:  # still out at the stop: the bench counts these as unfinished
        if o.done_s is None:
            o.reply = Reply(UNFINISHED)
    return driven
