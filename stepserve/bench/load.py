"""Load generators.

Open loop (the default): every send time is drawn in advance (a Trace); each request goes out at its scheduled
time whatever the target is doing, and its latency runs from the SCHEDULED send time, so a slow target cannot
hide its queueing delay by slowing the sender down.

Closed loop: N users, each sending its next request when the previous one has returned. The offered load falls
when the server slows down; results are labelled closed-loop and latency runs from each actual send.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from ..util.words import plural
from .targets import UNFINISHED, Reply, Target
from .workload import RequestSpec, Trace

START_LEAD_S = 0.05  # the schedule starts this long after the call, so the first sends are not late


@dataclass
class Outcome:
    """One request as the load generator saw it. Times are seconds after the start of the run."""

    index: int
    spec: RequestSpec
    scheduled_s: float  # when it was due to be sent (closed loop: when it was sent)
    sent_s: float | None = None  # when the send actually began
    done_s: float | None = None  # when the answer (or the error) came back
    warmup: bool = False  # scheduled inside the warm-up period: excluded from the numbers
    reply: Reply = field(default_factory=lambda: Reply(UNFINISHED))

    @property
    def status(self) -> str:
        return self.reply.status

    @property
    def latency_s(self) -> float | None:
        """From the scheduled send time to the answer; None unless completed."""
        if self.reply.status != "ok" or self.done_s is None:
            return None
        return self.done_s - self.scheduled_s


@dataclass
class LoadResult:
    outcomes: list[Outcome]
    start: float  # monotonic time of offset 0
    window_start_s: float  # the measured window, in seconds after start
    window_end_s: float
    mode: str  # "open-loop" | "closed-loop"
    description: str

    @property
    def measured(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.warmup]


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _send(target: Target, outcome: Outcome, start: float, on_done: Callable[[Outcome], None] | None) -> None:
    outcome.sent_s = _now() - start
    outcome.reply = await target.send(outcome.spec)
    outcome.done_s = _now() - start
    if on_done is not None:
        on_done(outcome)


async def _drain(tasks: list[asyncio.Task], deadline: float) -> None:
    """Wait for outstanding requests until `deadline` (monotonic); cancel the rest (they stay 'unfinished'). When
    the bench itself is cancelled (Ctrl-C, SIGTERM), every request goes with it."""
    pending = [t for t in tasks if not t.done()]
    try:
        if pending:
            _, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - _now()))
    finally:
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


async def run_open_loop(target: Target, trace: Trace, warmup_s: float, drain_s: float,
                        on_done: Callable[[Outcome], None] | None = None) -> LoadResult:
    """Send every trace item at its offset; requests scheduled before `warmup_s` are warm-up. After the last
    send, wait up to `drain_s` for answers; what is still out then is cancelled and counted as unfinished."""
    outcomes = [Outcome(i, item.spec, item.offset_s, warmup=item.offset_s < warmup_s)
                for i, item in enumerate(trace.items)]
    start = _now() + START_LEAD_S
    tasks: list[asyncio.Task] = []
    try:
        for outcome in outcomes:
            delay = start + outcome.scheduled_s - _now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(target, outcome, start, on_done)))
    except BaseException:  # cancelled while sending: the requests sent go with it
        await _drain(tasks, _now())
        raise
    end_s = max(trace.duration_s, warmup_s)
    await _drain(tasks, start + end_s + drain_s)
    return LoadResult(outcomes, start, warmup_s, end_s, "open-loop", trace.description)


async def run_closed_loop(target: Target, users: list, warmup_s: float, duration_s: float, drain_s: float,
                          on_done: Callable[[Outcome], None] | None = None) -> LoadResult:
    """`users` holds one request iterator per user (seeded, see workload.user_requests). Each user sends until
    warmup_s + duration_s; requests sent during the warm-up are excluded."""
    outcomes: list[Outcome] = []
    counter = itertools.count()
    start = _now() + START_LEAD_S
    end_s = warmup_s + duration_s

    async def user_loop(requests) -> None:
        await asyncio.sleep(max(0.0, start - _now()))
        while _now() - start < end_s:
            sent = _now() - start
            outcome = Outcome(next(counter), next(requests), sent, warmup=sent < warmup_s)
            outcomes.append(outcome)
            await _send(target, outcome, start, on_done)

    tasks = [asyncio.create_task(user_loop(r)) for r in users]
    await _drain(tasks, start + end_s + drain_s)
    outcomes.sort(key=lambda o: o.scheduled_s)
    description = f"closed-loop, {plural(len(users), 'user')} for {duration_s:g} s"
    return LoadResult(outcomes, start, warmup_s, end_s, "closed-loop", description)
