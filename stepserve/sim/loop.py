"""The step loop of the simulated clock: one or more EngineCores (replicas) driven through arrivals in simulated
time. The single-engine simulator (`simulate`), the simulated bench (sim.drive) and the replicas behind a router
(sim.replicas, with a sim.fleet.Fleet placing the requests) all run on this loop; the wall clock has its own loop
in the async engine.

Events are handled in time order: an arrival (placed on a replica at once by the fleet, or held in its central
queue; without a fleet everything goes to replica 0), a delivery (a request reaching the replica it was placed
on later, after loading its adapter or leaving the central queue), an abort, a tick of the fleet (publications,
autoscaling) and a replica's turn (the end of its current step, or the wake-up its policy asked for when idle).
As the live front end does (async_engine), a request is judged for admission when it reaches its replica, even
while the replica is in a step: its arrival time, and so its deadline, is then, and a refusal (or invalid input)
is told at that time. An admitted request joins the engine's queue at once (the step in flight was decided at its
start, so it cannot change that step); the replica's next turn is when its step ends (the duration the executor
reported), and an idle replica wakes at once. At equal times arrivals, deliveries and aborts come before ticks and
turns, so a request that arrives as a step ends joins the next step.

A replica may hold several models (sim.device.Models): one engine per model, one device. A request goes to the
engine of the model it names; at the replica's turn the device policy picks which ready engine steps, and the
turn ends with that step (an engine whose policy chooses to wait does not hold the device: the next one bids).

Time never passes by itself: nothing here reads the wall clock or sleeps, and ties are broken by the order in
which events were given, so the same inputs give the same run. Cost: two heaps of events (the arrivals, and the
rest: as few as the replicas), a few dictionary operations per request and one engine step per turn, so a run is
bounded by the engines themselves.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.admission_errors import AdmissionError
from ..engine.core import EngineCore
from ..request.types import Request, SamplingParams, StepReport
from ..request.validation import ValidationError
from .device import Models

INF = math.inf
MAX_EVENTS = 100_000_000  # a guard against a policy that never settles
_ARRIVE, _DELIVER, _ABORT, _TICK, _TURN = 0, 1, 2, 3, 4  # at equal times, in this order

# on_end(key, time, request, error): an arrival ended at `time`. `request` is the finished Request (any final
# status; a refusal at admission included) or None when the engine could not build one, or its replica was lost
# (`error` then says why).
Ended = Callable[[int, float, "Request | None", "Exception | None"], None]
Stepped = Callable[[int, float, StepReport], None]  # on_step(replica, time the step started, its report)


@dataclass
class Arrival:
    time: float
    params: SamplingParams
    abort_at: float | None = None  # the caller goes away at this time
    adapter: str | None = None  # the LoRA adapter it names, as the fleet sees it (sim.fleet models its load)
    model: str | None = None  # the model it names (None: its replica's default); see sim.device


class ReplicaLost(RuntimeError):
    """The replica holding the request stopped (failed) before answering it."""


class _Replica:
    __slots__ = ("core", "models", "next_t", "busy", "stamp")

    def __init__(self, core: EngineCore | Models) -> None:
        # several models sharing the replica's device (sim.device), or one engine; `core` is the (default) engine
        self.models = core if isinstance(core, Models) else None
        self.core = core.core if isinstance(core, Models) else core
        self.next_t = INF  # its next turn
        self.busy = False  # next_t is the end of a step (True) or a wake-up / nothing (False)
        self.stamp = 0  # bumped whenever next_t changes; stale turns in the heap are skipped


class SimLoop:
    """Replicas on one simulated clock. Give it arrivals (`arrive`, `abort`; also from inside the callbacks, at or
    after the time being handled), then `run`. `fleet`: places requests on replicas (sim.fleet.Fleet); needed for
    more than one replica. `stop_at`: the clock stops there and what is still out stays out (its end is not
    reported); None runs until every request has ended."""

    def __init__(self, cores: Sequence[EngineCore | Models], fleet: Any = None, stop_at: float | None = None,
                 max_events: int = MAX_EVENTS) -> None:
        if not cores:
            raise ValueError("the simulated clock needs at least one engine")
        if fleet is None and len(cores) > 1:
            raise ValueError("several replicas need a router")
        self.reps = [_Replica(c) for c in cores]
        self.fleet = fleet
        self.stop_at = INF if stop_at is None else stop_at
        self.max_events = max_events
        self.outstanding = [0] * len(cores)  # per replica: placed on it and not ended
        self.end_time = 0.0  # the time of the last arrival or turn handled
        self.stopped_early = False
        self.lost: set[int] = set()  # replicas that failed
        self.where: dict[int, int] = {}  # key -> replica, from placement until it ends
        self.model_of: dict[int, str] = {}  # key -> the model it went to, on a replica of several models
        self._heap: list[tuple] = []  # (time, kind, seq, key, payload) of every event but arrivals
        self._arrivals: list[tuple] = []  # arrivals, likewise; seq is unique across both heaps
        self._seq = 0
        if fleet is not None:
            fleet.attach(self)

    # --- input -------------------------------------------------------------------------------------------------
    def arrive(self, time: float, params: SamplingParams, key: int, adapter: str | None = None,
               model: str | None = None) -> None:
        """`model`: the model it names, on replicas of several models (None: the default; a replica of one model
        serves every request)."""
        self._seq += 1  # a heap of their own: the turns' heap stays as small as the fleet, the order is the same
        heapq.heappush(self._arrivals, (time, _ARRIVE, self._seq, key, (params, adapter, model)))

    def deliver(self, time: float, key: int, params: SamplingParams, replica: int, model: str | None = None) -> None:
        """Request `key` (already placed on `replica`) reaches it at `time`."""
        self._push(time, _DELIVER, key, (params, replica, model))

    def abort(self, time: float, key: int) -> None:
        """The caller of arrival `key` goes away at `time`; ignored unless it has arrived and not ended by then."""
        self._push(time, _ABORT, key, None)

    def tick(self, time: float) -> None:
        """Call the fleet's tick(time) then (publications, autoscaling)."""
        self._push(time, _TICK, -1, None)

    def add_replica(self, core: EngineCore | Models) -> int:
        self.reps.append(_Replica(core))
        self.outstanding.append(0)
        return len(self.reps) - 1

    def _push(self, time: float, kind: int, key: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, kind, self._seq, key, payload))

    # --- the run -----------------------------------------------------------------------------------------------
    def run(self, on_end: Ended, on_step: Stepped | None = None,
            on_route: Callable[[int, int], None] | None = None,
            after_event: Callable[[], bool] | None = None) -> None:
        """Handle every event up to stop_at. on_route(key, replica): where an arrival was placed. after_event():
        called after every event; True stops the run there (`stopped_early`)."""
        self.on_end, self.on_step = on_end, on_step
        self._live: dict[str, int] = {}  # request id -> key, while an engine has it
        self._ids: dict[int, str] = {}  # key -> request id, likewise
        events, arrivals, reps, horizon, fleet = self._heap, self._arrivals, self.reps, self.stop_at, self.fleet
        for _ in range(self.max_events):
            # the earlier of the two heaps' first events ((time, kind, seq) is unique: one order, as one heap)
            heap = arrivals if arrivals and (not events or arrivals[0] < events[0]) else events
            if not heap:
                break
            t, kind, _, key, payload = heap[0]
            if kind == _TURN and payload != reps[key].stamp:
                heapq.heappop(heap)  # superseded
                continue
            if t > horizon:
                break
            heapq.heappop(heap)
            if kind == _TURN:
                self.end_time = t
                self._turn(key, t)
            elif kind == _ARRIVE:
                self.end_time = t
                params, adapter, model = payload
                placed = (0, t) if fleet is None else fleet.place(t, key, params, adapter, model)
                if placed is not None:
                    r, at = placed
                    self.where[key] = r
                    self.outstanding[r] += 1
                    if on_route is not None:
                        on_route(key, r)
                    if at <= t:
                        self._reach(r, key, params, t, model)
                    else:
                        self.deliver(at, key, params, r, model)
            elif kind == _DELIVER:
                params, r, model = payload
                if self.where.get(key) == r and r not in self.lost:
                    self._reach(r, key, params, t, model)
            elif kind == _ABORT:
                r = self.where.get(key)
                if r is not None and key in self._ids:
                    model = self.model_of.get(key)
                    (reps[r].core if model is None else reps[r].models.cores[model]).abort(self._ids[key])
                    self._wake(r, t, model)
                elif r is not None or (fleet is not None and fleet.withdraw(key)):
                    self._end(key, t, None, _gone())  # still on its way (an adapter load, the central queue)
            else:
                fleet.tick(t)
            if after_event is not None and after_event():
                self.stopped_early = True
                break
        else:
            raise RuntimeError(f"simulation did not finish within {self.max_events} events")
        if horizon == INF and not self.stopped_early:
            stuck = [r for r, rep in enumerate(reps) if r not in self.lost and (rep.models or rep.core).has_work()]
            if stuck:
                raise RuntimeError(f"replica {stuck[0]} is stuck: work is queued but nothing can make progress")

    def fail(self, r: int, t: float) -> None:
        """Replica r is lost at t: everything it holds or is on its way to it ends as failed, now."""
        self.lost.add(r)
        self.reps[r].next_t, self.reps[r].busy = INF, False
        self.reps[r].stamp += 1
        for key in [k for k, rr in self.where.items() if rr == r]:
            self._ids.pop(key, None)
            self._end(key, t, None, ReplicaLost(f"replica {r} was lost before it answered"))

    def _end(self, key: int, t: float, request: Request | None, error: Exception | None) -> None:
        if t > self.stop_at:  # would have come after the stop: still out then
            return
        r = self.where.pop(key)
        self.model_of.pop(key, None)
        self.outstanding[r] -= 1
        self.on_end(key, t, request, error)
        if self.fleet is not None:
            self.fleet.left(r, key, t)

    def _reach(self, r: int, key: int, params: SamplingParams, t: float, model: str | None = None) -> None:
        """Request `key` reaches replica r at t: judged for admission now, queued in its engine if admitted. On a
        replica of several models, in the engine of the model it names (UnknownModel if it holds no such one)."""
        rep = self.reps[r]
        core = rep.core
        if rep.models is not None:
            model = rep.models.name_of(model)
            core = rep.models.cores[model]
            self.model_of[key] = model
        else:
            model = None
        try:
            request = core.new_request(params, t)
            # a replica in a step is judged from the end of that step (its next turn), when its engine can next
            # act: the core already holds the step's result, so predicting from `t` would count it as free
            core.check_admission(request, max(t, rep.next_t) if rep.busy else t)
        except AdmissionError as exc:  # the engine's own report of it (next step) is skipped: not live
            exc.request.timing.finished = t  # told now, not at the end of the step it was judged from
            self._end(key, t, exc.request, exc)
            self._wake(r, t, model)  # the engine reports the refusal in a step
            return
        except ValidationError as exc:
            self._end(key, t, None, exc)
            return
        core.enqueue(request)
        self._live[request.request_id] = key
        self._ids[key] = request.request_id
        self._wake(r, t, model)

    def _wake(self, r: int, t: float, model: str | None = None) -> None:
        rep = self.reps[r]
        if model is not None:
            rep.models.wake(model, t)
        if not rep.busy and t < rep.next_t and r not in self.lost:
            self._schedule(r, t, False)

    def _turn(self, r: int, t: float) -> None:
        rep = self.reps[r]
        if rep.models is not None:
            self._turn_models(r, t)
            return
        core = rep.core
        if t >= self.stop_at or not core.has_work():
            self._schedule(r, INF, False)
            return
        report = core.step(t)
        self._stepped(r, t, report)
        if report.duration_s > 0:
            self._schedule(r, t + report.duration_s, True)
        elif report.finished:
            self._schedule(r, t, True)  # something ended at no cost: look again at once
        else:  # idle: until the policy's wake-up, or an arrival
            self._schedule(r, INF if report.wake_at is None else max(report.wake_at, t), False)

    def _turn_models(self, r: int, t: float) -> None:
        """A turn of a replica of several models: the device policy picks which ready engine steps (sim.device);
        one whose policy chooses to wait does not hold the device, so the next one bids at once."""
        models, tried = self.reps[r].models, set()
        while t < self.stop_at:
            model = models.pick(t, tried)
            if model is None:
                break
            report = models.step(model, t)
            self._stepped(r, t, report)
            if report.duration_s > 0:
                self._schedule(r, t + report.duration_s, True)
                return
            if report.finished:
                self._schedule(r, t, True)  # something ended at no cost: look again at once
                return
            tried.add(model)
        self._schedule(r, models.next_wake() if t < self.stop_at else INF, False)

    def _stepped(self, r: int, t: float, report: StepReport) -> None:
        if self.on_step is not None:
            self.on_step(r, t, report)
        for req in report.finished:
            key = self._live.pop(req.request_id, None)
            if key is not None:
                del self._ids[key]
                self._end(key, req.timing.finished, req, None)

    def _schedule(self, r: int, t: float, busy: bool) -> None:
        rep = self.reps[r]
        rep.next_t, rep.busy = t, busy
        rep.stamp += 1
        if t < INF:
            self._push(t, _TURN, r, rep.stamp)


def _gone() -> Exception:
    return RuntimeError("the caller went away before the request reached a replica")
