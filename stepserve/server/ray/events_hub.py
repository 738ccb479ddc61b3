"""The console's hub under Ray Serve: every replica's step records, merged for every viewer of the live view.

EventsHub runs as one small actor (ray/console.py: num_cpus=0, like the metrics hub); nothing here imports Ray, so
a test drives it in-process. Its two sides (ray/fleet_events.py holds the code on each):

- **Replicas** `join` with their hello (model, strategy, batch bound, recent finished requests) and get the hub's
  clock, so that their records' `t` all count from the hub's start; then, only while someone watches, they `put`
  their batches of records (JSON text, each record labelled with its replica) as their engines step. `put` answers
  how many readers watch: at 0 a replica stops building records. `wait_watched` is a long poll that answers as soon
  as a reader arrives (None once the hub has closed); `leave` when a replica stops. A replica silent for STALE_S (killed) drops out.
- **Readers** (the console's stream processes) `read` from a cursor: a long poll that answers with the items since
  (`("steps", batch)` and `("replicas", names)` when replicas come or go) as soon as there are any. `hello()` is
  the merged hello a new viewer gets first. `close()` (the server is stopping) ends every read: their streams end.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable

RECENT = 500  # finished requests in the merged hello (as events.RECENT for one engine)
KEEP = 256  # items kept for readers; one that falls further behind skips to the oldest kept
STALE_S = 15.0  # a replica not heard from for this long (its wait_watched polls come every WAIT_S) has gone
READER_STALE_S = 15.0  # a reader that has not read for this long has gone


class EventsHub:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.closed = False
        self._replicas: dict[str, dict] = {}  # name -> {"hello": its last hello, "seen": hub time}
        self._recent: dict[str, deque] = {}  # name -> its recent finished requests
        self._items: deque[tuple[int, tuple[str, object]]] = deque(maxlen=KEEP)
        self._seq = 0
        self._readers: dict[str, float] = {}  # reader -> when it last read (hub time)
        self._wake: asyncio.Event | None = None  # set when an item or a reader arrives, or on close

    def now(self) -> float:
        """Seconds since the hub started: the time base of every record a viewer sees."""
        return round(self.clock() - self.started, 4)

    # --- replicas ------------------------------------------------------------------------------------------------
    def join(self, name: str, hello: dict) -> float:
        """A replica (re)announces itself with its hello; the hub's now(), for its records' time base."""
        new = name not in self._replicas
        self._replicas[name] = {"hello": hello, "seen": self.clock()}
        self._recent[name] = deque(hello.get("recent", ()), maxlen=RECENT)
        if new:
            self._announce()
        return self.now()

    def put(self, name: str, batch: str | None) -> int:
        """A replica's batch of records (None: only a sign of life). How many readers watch now: 0 tells the
        replica to stop sending, and also answers a replica the hub does not know (dropped as stale): it sends again
        after its next join."""
        entry = self._replicas.get(name)
        if entry is None:
            return 0
        entry["seen"] = self.clock()
        if batch is not None:
            recent = self._recent[name]
            for record in json.loads(batch):
                recent.extend(done[1:] for done in record.get("done", ()))
            self._add(("steps", batch))
        return self.watching()

    async def wait_watched(self, name: str, timeout_s: float) -> bool | None:
        """(a replica) Whether anyone watches: answers at once if so, else when a reader arrives or after
        timeout_s (False); None once the hub is closed (the server is stopping: nothing more to send). Each call is
        also a sign of life."""
        deadline = self.clock() + timeout_s
        while True:
            if name in self._replicas:
                self._replicas[name]["seen"] = self.clock()
            if self.closed:
                return None
            if self.watching():
                return True
            left = deadline - self.clock()
            if left <= 0 or not await self._wait(left):
                return False

    def leave(self, name: str) -> None:
        if self._replicas.pop(name, None) is not None:
            self._recent.pop(name, None)
            self._announce()

    # --- readers -------------------------------------------------------------------------------------------------
    async def read(self, reader: str, cursor: int | None, timeout_s: float) -> tuple[int, list, bool]:
        """(a reader) The items after `cursor` (None: from now on): (the new cursor, the items, whether the hub is
        closed). Waits up to timeout_s for the first item."""
        first = reader not in self._readers
        self._readers[reader] = self.clock()
        if first:
            self._notify()  # replicas waiting in wait_watched start sending
        if cursor is None:
            cursor = self._seq
        deadline = self.clock() + timeout_s
        while True:
            self._drop_stale()
            items = [item for seq, item in self._items if seq > cursor]
            if items or self.closed:
                break
            left = deadline - self.clock()
            if left <= 0 or not await self._wait(left):
                break
        self._readers[reader] = self.clock()
        return self._seq, items, self.closed

    def unread(self, reader: str) -> None:
        """A reader whose last viewer left."""
        self._readers.pop(reader, None)

    def watching(self) -> int:
        now = self.clock()
        for reader in [r for r, at in self._readers.items() if now - at > READER_STALE_S]:
            del self._readers[reader]
        return len(self._readers)

    def hello(self) -> dict:
        """What a new viewer gets first: the model and settings of the replicas (the first by name), every
        replica's recent finished requests, the hub's now, and the replicas' names."""
        self._drop_stale()
        names = sorted(self._replicas)
        first = self._replicas[names[0]]["hello"] if names else {}
        recent = [r for name in names for r in self._recent[name]][-RECENT:]
        return {"model": first.get("model"), "max_batch_size": first.get("max_batch_size"),
                "strategy": first.get("strategy"), "recent": recent, "t": self.now(), "replicas": names}

    def close(self) -> None:
        """The server is stopping: every read answers closed, every stream ends."""
        self.closed = True
        self._notify()

    # --- inside --------------------------------------------------------------------------------------------------
    def _add(self, item: tuple[str, object]) -> None:
        self._seq += 1
        self._items.append((self._seq, item))
        self._notify()

    def _announce(self) -> None:
        self._add(("replicas", sorted(self._replicas)))

    def _drop_stale(self) -> None:
        now = self.clock()
        gone = [name for name, entry in self._replicas.items() if now - entry["seen"] > STALE_S]
        for name in gone:
            self.leave(name)

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    async def _wait(self, timeout_s: float) -> bool:
        """Until the next item, reader or close (True), or timeout_s (False)."""
        if self._wake is None:
            self._wake = asyncio.Event()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
