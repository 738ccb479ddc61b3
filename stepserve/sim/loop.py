"""The step loop of the simulated clock: one or more EngineCores (replicas) driven through arrivals in simulated
time. The single-engine simulator (`simulate`), the simulated bench (sim.drive) and the replicas behind a router
(sim.replicas) all run on this loop; the wall clock has its own loop in the async engine.

Events are handled in time order: an arrival (routed to a replica at once, from the replicas' outstanding counts
at that moment; without a router everything goes to replica 0), an abort, and a replica's turn (the end of its
current step, or the wake-up its policy asked for when idle). As the live front end does (async_engine), an
arrival is made into a request and judged for admission at its arrival time, even while its replica is in a
step: the request's arrival time, and so its deadline, is when it arrived, and a refusal (or invalid input) is
told at that time. Admitted requests and aborts wait in the replica's inbox; at its turn the replica hands the
inbox to its engine and runs one step at that time, and its next turn is when that step ends (the duration the
executor reported). A request routed to an idle replica wakes it at once. At equal times arrivals and aborts come
before turns, so a request that arrives as a step ends joins the next step.

Time never passes by itself: nothing here reads the wall clock or sleeps, and ties are broken by the order in
which events were given, so the same inputs give the same run. Cost: a heap of events, a few dictionary operations
per request and one engine step per turn, so a run is bounded by the engines themselves.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..engine.admission_errors import AdmissionError
from ..engine.core import EngineCore
from ..request.types import Request, SamplingParams, StepReport
from ..request.validation import ValidationError
from .routers import Router

INF = math.inf
MAX_EVENTS = 100_000_000  # a guard against a policy that never settles
_ARRIVE, _ABORT, _TURN = 0, 1, 2  # at equal times: arrivals, then aborts, then turns

# on_end(key, time, request, error): an arrival ended at `time`. `request` is the finished Request (any final
# status; a refusal at admission included) or None when the engine could not build one (`error` then says why).
Ended = Callable[[int, float, "Request | None", "Exception | None"], None]
Stepped = Callable[[int, float, StepReport], None]  # on_step(replica, time the step started, its report)


@dataclass
class Arrival:
    time: float
    params: SamplingParams
    abort_at: float | None = None  # the caller goes away at this time


class _Replica:
    __slots__ = ("core", "inbox", "next_t", "busy", "stamp")

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.inbox: list[tuple[int, int, Request | None]] = []  # (kind, key, admitted request) not yet handed over
        self.next_t = INF  # its next turn
        self.busy = False  # next_t is the end of a step (True) or a wake-up / nothing (False)
        self.stamp = 0  # bumped whenever next_t changes; stale turns in the heap are skipped


class SimLoop:
    """Replicas on one simulated clock. Give it arrivals (`arrive`, `abort`; also from inside the callbacks, at or
    after the time being handled), then `run`. `stop_at`: the clock stops there and what is still out stays out
    (its end is not reported); None runs until every request has ended."""

    def __init__(self, cores: Sequence[EngineCore], router: Router | None = None, stop_at: float | None = None,
                 max_events: int = MAX_EVENTS) -> None:
        if not cores:
            raise ValueError("the simulated clock needs at least one engine")
        if router is None and len(cores) > 1:
            raise ValueError("several replicas need a router")
        self._reps = [_Replica(c) for c in cores]
        self.router = router
        self.stop_at = INF if stop_at is None else stop_at
        self.max_events = max_events
        self.outstanding = [0] * len(cores)  # per replica: routed and not ended
        self.end_time = 0.0  # the time of the last arrival or turn handled
        self.stopped_early = False
        self._heap: list[tuple] = []
        self._seq = 0

    def arrive(self, time: float, params: SamplingParams, key: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, _ARRIVE, self._seq, key, params))

    def abort(self, time: float, key: int) -> None:
        """The caller of arrival `key` goes away at `time`; ignored unless it has arrived and not ended by then."""
        self._seq += 1
        heapq.heappush(self._heap, (time, _ABORT, self._seq, key, None))

    def run(self, on_end: Ended, on_step: Stepped | None = None,
            on_route: Callable[[int, int], None] | None = None,
            after_event: Callable[[], bool] | None = None) -> None:
        """Handle every event up to stop_at. on_route(key, replica): where an arrival went. after_event(): called
        after every event; True stops the run there (`stopped_early`)."""
        heap, reps, horizon = self._heap, self._reps, self.stop_at
        live: dict[str, int] = {}  # request id -> key, while the engine has it
        ids: dict[int, str] = {}  # key -> request id, likewise
        where: dict[int, int] = {}  # key -> replica, from routing until it ends

        def end(key: int, t: float, request: Request | None, error: Exception | None) -> None:
            if t > horizon:  # would have come after the stop: still out then
                return
            self.outstanding[where.pop(key)] -= 1
            on_end(key, t, request, error)

        def admit(rep: _Replica, key: int, params: SamplingParams, t: float) -> Request | None:
            """The request that arrived at `t` (its arrival time and deadline count from `t`), judged for
            admission at once, as the live front end does, with the admitted requests of the inbox ahead of it.
            None when it was refused or invalid; that is told at `t`. A replica in a step is judged from the end
            of that step (its next turn), when its engine can next act: the core already holds the step's result,
            so predicting from `t` would count the rest of the step as free."""
            try:
                request = rep.core.new_request(params, t)
                ahead = [item for kind, _, item in rep.inbox if kind == _ARRIVE]
                rep.core.check_admission(request, max(t, rep.next_t) if rep.busy else t, ahead)
            except AdmissionError as exc:  # the engine's own report of it (next step) is skipped: not live
                exc.request.timing.finished = t  # told now, not at the end of the step it was judged from
                end(key, t, exc.request, exc)
                return None
            except ValidationError as exc:
                end(key, t, None, exc)
                return None
            live[request.request_id] = key
            ids[key] = request.request_id
            return request

        def turn(r: int, t: float) -> None:
            rep = reps[r]
            core = rep.core
            for kind, key, request in rep.inbox:
                if kind == _ABORT:
                    if key in ids:
                        core.abort(ids[key])
                    continue
                core.enqueue(request)
            rep.inbox.clear()
            if t >= horizon or not core.has_work():
                self._schedule(r, INF, False)
                return
            report = core.step(t)
            if on_step is not None:
                on_step(r, t, report)
            for req in report.finished:
                key = live.pop(req.request_id, None)
                if key is not None:
                    del ids[key]
                    end(key, req.timing.finished, req, None)
            if report.duration_s > 0:
                self._schedule(r, t + report.duration_s, True)
            elif report.finished:
                self._schedule(r, t, True)  # something ended at no cost: look again at once
            else:  # idle: until the policy's wake-up, or an arrival
                self._schedule(r, INF if report.wake_at is None else max(report.wake_at, t), False)

        for _ in range(self.max_events):
            if not heap:
                break
            event = heap[0]
            t, kind = event[0], event[1]
            if kind == _TURN and event[3] != reps[event[2]].stamp:
                heapq.heappop(heap)  # superseded
                continue
            if t > horizon:
                break
            heapq.heappop(heap)
            if kind == _TURN:
                self.end_time = t
                turn(event[2], t)
            else:
                r = self._route(event[3], kind, where)
                if r is None:
                    continue
                if kind == _ARRIVE:
                    self.end_time = t
                    if on_route is not None:
                        on_route(event[3], r)
                rep = reps[r]
                item = event[4] if kind == _ABORT else admit(rep, event[3], event[4], t)
                if kind == _ABORT or item is not None:  # a refused or invalid arrival was told already
                    rep.inbox.append((kind, event[3], item))
                if not rep.busy and t < rep.next_t:  # a refusal too: the engine reports it in a step
                    self._schedule(r, t, False)
            if after_event is not None and after_event():
                self.stopped_early = True
                break
        else:
            raise RuntimeError(f"simulation did not finish within {self.max_events} events")
        if horizon == INF and not self.stopped_early:
            stuck = [r for r, rep in enumerate(reps) if rep.core.has_work() or rep.inbox]
            if stuck:
                raise RuntimeError(f"replica {stuck[0]} is stuck: work is queued but nothing can make progress")

    def _route(self, key: int, kind: int, where: dict[int, int]) -> int | None:
        """The replica an arrival goes to (routing it), or the one an abort goes to (None: nothing to abort)."""
        if kind == _ABORT:
            return where.get(key)
        r = 0 if self.router is None else self.router.pick(self.outstanding)
        if not 0 <= r < len(self._reps):
            raise ValueError(f"router {getattr(self.router, 'name', self.router)!r} picked replica {r} of "
                             f"{len(self._reps)}")
        where[key] = r
        self.outstanding[r] += 1
        return r

    def _schedule(self, r: int, t: float, busy: bool) -> None:
        rep = self._reps[r]
        rep.next_t, rep.busy = t, busy
        rep.stamp += 1
        if t < INF:
            heapq.heappush(self._heap, (t, _TURN, r, rep.stamp, None))
