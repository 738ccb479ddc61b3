"""The two ends of the console's hub (events_hub.py) under Ray Serve; nothing here imports Ray.

`hub` is a handle on the hub actor: each method is called as `hub.method.remote(...)` and awaited (a test passes
an in-process stand-in with the same shape).

- forward() runs in every engine replica: it gives the replica's records a label (the replica's id) and the hub's
  time base, and sends them to the hub while anyone watches, as one more viewer of the replica's own EngineEvents.
  While no one watches it builds no record and waits in one long poll.
- FleetEvents feeds /v1/engine/events in the console's own deployment: one read loop per process (while it has
  viewers) takes the hub's items and offers them to its viewers (viewers.py: at most MAX_VIEWERS per process).
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..viewers import Viewers

WAIT_S = 5.0  # the long polls' length: a replica's wait for a viewer, a reader's wait for records

log = logging.getLogger("stepserve.server")


async def forward(hub, events, name: str) -> None:
    """(an engine replica) Its step records to the hub, labelled `name`, while the console has viewers; returns
    when the replica's events or the hub close. Cancel it when the replica stops."""
    events.label = name
    await _join(hub, events, name)
    while not events.closed:
        watched = await hub.wait_watched.remote(name, WAIT_S)
        if watched is None:  # the hub has closed: the server is stopping
            return
        if not watched:
            continue
        queue = events.subscribe()
        try:
            await _join(hub, events, name)  # fresh recent requests for the viewers' latency view
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), WAIT_S)
                except asyncio.TimeoutError:
                    item = ("alive", None)  # an idle engine: still here
                if item is None:  # the replica is draining
                    return
                if not await hub.put.remote(name, item[1]):
                    break  # no one watches any more (or the hub forgot this replica: join again first)
        finally:
            events.unsubscribe(queue)


async def _join(hub, events, name: str) -> None:
    """Announce the replica; its records' `t` then counts from the hub's start (the call's midpoint as the
    moment the hub read its clock)."""
    sent = time.monotonic()
    hub_now = await hub.join.remote(name, events.hello())
    events.started = (sent + time.monotonic()) / 2 - hub_now


class FleetEvents:
    """The console's stream in a process without an engine: every replica's records, read from the hub. The same
    interface as events.EngineEvents (subscribe, unsubscribe, chunks, close, viewers), plus run(): the read loop."""

    def __init__(self, hub, name: str) -> None:
        self.hub = hub
        self.name = name  # this process, for the hub (each stretch of reading has a name of its own)
        self._viewers = Viewers()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wanted: asyncio.Event | None = None  # set when a viewer arrives

    async def run(self) -> None:
        """Read the hub while there are viewers, for the process's lifetime. Start it once where the process
        starts, never inside a viewer's request: Ray cancels the calls a request made when it ends, so a loop started
        by the first viewer would fail as that viewer left."""
        self._loop, self._wanted = asyncio.get_running_loop(), asyncio.Event()
        stretch = 0
        while not self.closed:
            if not len(self._viewers):
                self._wanted.clear()
                await self._wanted.wait()
                continue
            stretch += 1
            await self._read(f"{self.name}/{stretch}")

    def subscribe(self) -> asyncio.Queue:
        queue = self._viewers.add()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wanted.set)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._viewers.remove(queue)  # the read loop stops after the read in flight once no viewer is left

    def chunks(self, queue: asyncio.Queue):
        return self._viewers.stream(queue, self._hello)

    def close(self) -> None:
        self._viewers.close()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wanted.set)

    @property
    def closed(self) -> bool:
        return self._viewers.closed

    @property
    def viewers(self) -> int:
        return len(self._viewers)

    async def _hello(self) -> dict:
        return await self.hub.hello.remote()

    async def _read(self, reader: str) -> None:
        cursor = None
        try:
            while len(self._viewers) and not self.closed:
                cursor, items, closed = await self.hub.read.remote(reader, cursor, WAIT_S)
                for kind, data in items:
                    self._viewers.offer(("steps", data) if kind == "steps" else (kind, {"replicas": data}))
                if closed:
                    self.close()
        except Exception as exc:  # noqa: BLE001 - the hub is gone (the server is stopping): the streams end
            if not self.closed:
                log.warning("the console's stream lost the hub: %s", exc)
                self.close()
        try:
            await self.hub.unread.remote(reader)
        except Exception:  # noqa: BLE001 - the hub is gone: nothing to tell it
            pass
