"""One device shared by several models' engines (a server of several models, server/models.py): one step at a
time, and the device's memory shared by use.

Turns: each model's engine thread asks for the device before each step (`turn`), bidding its most urgent deadline;
the pure DeviceShare policy (scheduling/device_share.py) picks among the bids whenever the device frees, and the
step's reported duration is charged to its model. The simulator runs the same policy over its own clock.

Memory: every model has a place (scheduling/residency.py): on the device, in host memory or on disk. A model's
engine moves it back to the device inside its own turn (`turn` calls its mover), after moving the idle least
recently used models out to host memory if the device's budget needs it; host memory over its budget sends its idle
least recently used models back to disk (`to_disk`: the server drops their engines). Moves run while the mover
holds the device, so no step of the moved model can run meanwhile; a model with requests in flight never moves.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..scheduling.device_share import DeviceShare, EngineBid
from ..scheduling.residency import DEVICE, DISK, HOST, Placed, make_room
from .clock import WallClock

log = logging.getLogger(__name__)
MEMORY = "(memory)"  # the device's holder while models move for a load


@dataclass
class Resident:
    """One model as the device sees it; its counters are what /v1/models and the metrics show."""

    name: str
    nbytes: int
    place: str
    mover: Callable[[str], None]  # mover(DEVICE | HOST): move the weights there (blocking)
    busy: Callable[[], bool]  # requests in flight (queued, running, being read by the server, jobs it owns)
    active: Callable[[], bool]  # its engine has work now (cheap: read at every step for the shares)
    last_used: float = 0.0
    work_s: float = 0.0  # smoothed duration of its steps: the predicted work of its next one
    steps: int = 0
    device_s: float = 0.0  # device time its steps took
    moves: dict[str, int] = field(default_factory=dict)  # place -> moves there
    move_s: dict[str, float] = field(default_factory=dict)  # place -> seconds those moves took
    load_s: float | None = None  # the last load from disk (seconds), for the estimate of the next
    wait_s: float = 0.0  # time its steps waited for the device (bid to turn)
    wait_s_max: float = 0.0  # the longest of those waits


class SharedDevice:
    """The turns and the memory of one device (see the module docstring). `device_bytes` / `host_bytes`: the
    budgets (None: unbounded). `to_disk(name)`: called (on the thread that moved it) when a model should go back to
    disk; the owner drops its engine and calls `remove`."""

    def __init__(self, share: DeviceShare | None = None, device_bytes: int | None = None,
                 host_bytes: int | None = None, to_disk: Callable[[str], None] | None = None, clock=None) -> None:
        self.share = share or DeviceShare()
        self.device_bytes, self.host_bytes = device_bytes, host_bytes
        self.to_disk = to_disk
        self.clock = clock or WallClock()
        self.models: dict[str, Resident] = {}
        self.on_turn: list[Callable[[str, float, float], None]] = []  # (model, started, seconds) after each step
        self.holder: str | None = None  # the model whose step runs now (MEMORY while models move for a load)
        self.reserved: dict[str, int] = {}  # bytes held on the device for models being loaded
        self._cond = threading.Condition()
        self._bids: dict[str, EngineBid] = {}
        self._exclusive_waiting = 0  # loads waiting to move models (_exclusive): served before any bid
        self._closed = False

    # --- turns -------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def turn(self, model: str, deadline: float | None) -> Iterator[Callable[..., None]]:
        """Hold the device for one step of `model` (blocks until the policy picks it), with the model on the device.
        Yields took(seconds, again=False, deadline=None): the step's duration (the executor's, not a clock's), and
        whether the engine has more work: then it bids for its next step at the release itself, so that the policy
        chooses between it and the engines waiting (a bid made only after the release would always find the device
        handed on, and two busy models would merely alternate). An engine that bid so and then does not step calls
        withdraw()."""
        with self._cond:
            early = self._bids.get(model)  # made at the release of its last step: it has waited since then
            bid = self._bids[model] = EngineBid(model, self.clock.now() if early is None else early.waiting_since,
                                                deadline, self._work_s(model))  # the deadline as of now
            if self.holder is None:
                self._grant()
            while self.holder != model and not self._closed:
                self._cond.wait()
            self._bids.pop(model, None)
            if self._closed and self.holder != model:
                raise RuntimeError("the shared device was closed")
            started = self.clock.now()
            r = self.models.get(model)
            if r is not None:
                r.wait_s += started - bid.waiting_since
                r.wait_s_max = max(r.wait_s_max, started - bid.waiting_since)
        done: dict = {"seconds": 0.0, "again": False, "deadline": None}

        def took(seconds: float, again: bool = False, deadline: float | None = None) -> None:
            done.update(seconds=seconds, again=again, deadline=deadline)

        try:
            self._to_device(model)
            yield took
        finally:
            seconds = done["seconds"]
            with self._cond:
                self.share.charge(model, seconds)
                r = self.models.get(model)
                if r is not None:
                    r.last_used = self.clock.now()
                    if seconds > 0:
                        r.steps += 1
                        r.device_s += seconds
                        r.work_s = seconds if r.work_s == 0 else 0.8 * r.work_s + 0.2 * seconds
                self.holder = None
                if done["again"] and not self._closed:
                    self._bids[model] = EngineBid(model, self.clock.now(), done["deadline"], self._work_s(model))
                self._grant()
            if seconds > 0:
                for callback in self.on_turn:
                    callback(model, started, seconds)

    def withdraw(self, model: str) -> None:
        """The engine of `model` will not step now (no work, or it stops): its bid goes, and a turn handed to it
        at its last release passes on."""
        with self._cond:
            self._bids.pop(model, None)
            if self.holder == model:
                self.holder = None
                self._grant()

    def share_now(self, model: str) -> float:
        """The share of the device `model` gets now: its weight over those of the models with work (bidding, or
        busy), itself included. Its slo policy plans at it (scheduling/device_share.plan_at)."""
        with self._cond:
            active = set(self._bids) | {r.name for r in self.models.values()
                                        if r.name != model and r.place != DISK and r.active()}
            return self.share.share_now(model, sorted(active), self.clock.now())

    def _grant(self) -> None:  # under the lock, the device free: a load's moves first, else the policy's pick
        if self._exclusive_waiting:
            self._cond.notify_all()  # the device stays free for the loader (_exclusive) to take
        elif self._bids:
            self.holder = self.share.pick(list(self._bids.values()), self.clock.now()).model
            self._cond.notify_all()

    def _work_s(self, model: str) -> float:
        r = self.models.get(model)
        return r.work_s if r is not None else 0.0

    def close(self) -> None:
        """Wake every waiting engine (the server is stopping)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # --- memory ------------------------------------------------------------------------------------------------
    def add(self, name: str, nbytes: int, mover: Callable[[str], None], busy: Callable[[], bool],
            active: Callable[[], bool] | None = None, load_s: float | None = None) -> None:
        """A model just loaded onto the device (its reservation, if any, becomes its place). Its size is now
        measured: when that is more than was reserved, idle models move out until the budget holds again."""
        with self._cond:
            self.reserved.pop(name, None)
            old = self.models.get(name)
            r = Resident(name, nbytes, DEVICE, mover, busy, active or busy, last_used=self.clock.now(),
                         load_s=load_s)
            if old is not None:  # loaded again after going to disk: its counters carry on
                r.moves, r.move_s, r.steps, r.device_s = old.moves, old.move_s, old.steps, old.device_s
            r.moves[DEVICE] = r.moves.get(DEVICE, 0)
            self.models[name] = r
            on_device = sum(m.nbytes for m in self.models.values() if m.place == DEVICE) + sum(self.reserved.values())
        if self.device_bytes is not None and on_device > self.device_bytes:  # only then ask who is busy
            with self._exclusive():
                out = make_room(self._placed(), DEVICE, 0, self.device_bytes, keep=name)
                if out is None:
                    log.warning("model %s (%.0f MiB measured) is over --device-memory-mb: the other models on the "
                                "device have requests in flight", name, nbytes / 2**20)
                self._move_out(out or [])

    def remove(self, name: str) -> None:
        """The model went back to disk (its engine was dropped); its counters stay for /v1/models."""
        with self._cond:
            r = self.models.get(name)
            if r is not None:
                r.place = DISK
            self.reserved.pop(name, None)

    def touch(self, name: str) -> None:
        """The model was just used (a request answered): the most recently used now."""
        with self._cond:
            r = self.models.get(name)
            if r is not None:
                r.last_used = self.clock.now()

    def back_to_host(self, name: str) -> None:
        """A model sent to disk that got a request before its engine was dropped: it stays, in host memory."""
        with self._cond:
            r = self.models.get(name)
            if r is not None and r.place == DISK:
                r.place = HOST

    def reserve(self, name: str, nbytes: int) -> bool:
        """Room on the device for a model about to load: idle models move out to host memory first (holding the
        device, so none of them steps meanwhile). False when it cannot fit now (every other model is busy)."""
        with self._exclusive():
            out = make_room(self._placed(), DEVICE, nbytes, self.device_bytes, keep=name)
            if out is None:
                return False
            self._move_out(out)
            with self._cond:
                self.reserved[name] = nbytes
            return True

    def unreserve(self, name: str) -> None:
        with self._cond:
            self.reserved.pop(name, None)

    def _to_device(self, model: str) -> None:  # holding the device
        r = self.models.get(model)
        if r is None or r.place == DEVICE:
            return
        out = make_room(self._placed(), DEVICE, r.nbytes, self.device_bytes, keep=model)
        if out is None:
            log.warning("model %s moves back to the device over --device-memory-mb: every other model there has "
                        "requests in flight", model)
        self._move_out(out or [])
        self._move(r, DEVICE)

    def _move_out(self, names: list[str]) -> None:
        for name in names:
            try:
                self._move(self.models[name], HOST)
            except Exception:  # noqa: BLE001 - the step or load that needed the room goes on, over the budget
                log.exception("model %s could not move to host memory; it stays on the device (over "
                              "--device-memory-mb until it moves)", name)
        gone = make_room(self._placed(), HOST, 0, self.host_bytes)
        for name in gone or []:
            r = self.models[name]
            with self._cond:
                r.place = DISK
                r.moves[DISK] = r.moves.get(DISK, 0) + 1
            if self.to_disk is not None:
                self.to_disk(name)

    def _move(self, r: Resident, place: str) -> None:
        started = self.clock.now()
        try:
            r.mover(place)
        except BaseException:
            try:
                r.mover(r.place)  # back where it was, whole: never half on one device and half on the other
            except Exception:  # noqa: BLE001 - the first failure is the one to report
                log.exception("model %s could not move back to %s memory either", r.name, r.place)
            raise
        seconds = self.clock.now() - started
        with self._cond:
            r.place = place
            r.moves[place] = r.moves.get(place, 0) + 1
            r.move_s[place] = r.move_s.get(place, 0.0) + seconds
        log.info("model %s moved to %s memory in %.3f s", r.name, place, seconds)

    def _placed(self) -> list[Placed]:
        """What the memory policy reads. busy() may ask the state store (jobs queued for the model): it is asked
        outside the device's lock, so a slow store never holds up the others' turns."""
        with self._cond:
            models = [(r, r.name, r.place, r.nbytes, r.last_used) for r in self.models.values() if r.place != DISK]
            now = self.clock.now()
            reserved = [Placed(n, DEVICE, b, now, True) for n, b in self.reserved.items()]
        return [Placed(name, place, nbytes, last, r.busy()) for r, name, place, nbytes, last in models] + reserved

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the device between steps, ahead of every bid (a load's moves)."""
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self.holder is not None and not self._closed:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            if self._closed:
                raise RuntimeError("the shared device was closed")
            self.holder = MEMORY
        try:
            yield
        finally:
            with self._cond:
                self.holder = None
                self._grant()

    def describe(self, name: str) -> dict:
        """Where a model is and what moving it has cost: for /v1/models and the metrics."""
        with self._cond:
            r = self.models.get(name)
            if r is None:
                return {"place": DEVICE if name in self.reserved else DISK, "loading": name in self.reserved}
            return {"place": r.place, "bytes": r.nbytes, "steps": r.steps, "device_s": round(r.device_s, 3),
                    "wait_s": round(r.wait_s, 3), "wait_s_max": round(r.wait_s_max, 3),
                    "moves": dict(r.moves), "move_s": {k: round(v, 3) for k, v in r.move_s.items()},
                    "load_s": None if r.load_s is None else round(r.load_s, 3)}
