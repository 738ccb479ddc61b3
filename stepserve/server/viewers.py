"""The viewers of the console's live stream in one serving process: one bounded queue each, fed by whatever makes
the records (events.py: this process's engine; ray/fleet_events.py: every replica's, through the hub), and their
Server-Sent Events body.

A stream never ends by itself, so each one holds a connection for as long as its tab is open. One process feeds at
most MAX_VIEWERS of them; the next is refused with 429 and Retry-After (the OpenAI error shape) until one closes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from .errors import APIError
from .streaming import sse

MAX_VIEWERS = 16  # live streams one serving process feeds at once (docs/HTTP_API.md)
VIEWERS_RETRY_S = 10  # Retry-After for the viewer past the cap: a place frees when a tab closes, not by itself
QUEUE = 256  # batches a viewer may fall behind by before the oldest are dropped
KEEPALIVE_S = 15.0

Item = tuple[str, "str | dict"]  # (SSE event name, its data: JSON text, or a dict to write as JSON)


def too_many_viewers(cap: int) -> APIError:
    return APIError(429, f"the console's live view already has {cap} viewers on this server, the most one server "
                         f"process feeds at once; close another console tab or events client, or retry after "
                         f"{VIEWERS_RETRY_S} s", type="rate_limit_error", code="too_many_viewers",
                    headers={"Retry-After": str(VIEWERS_RETRY_S)})


class Viewers:
    """The open streams of one process. add/remove/offer run on the event loop; close() and the count from any
    thread."""

    def __init__(self, cap: int = MAX_VIEWERS) -> None:
        self.cap = cap
        self.closed = False  # the server is stopping: every stream ends, and a new one ends after its hello
        self._lock = threading.Lock()
        self._open: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []

    def add(self) -> asyncio.Queue:
        """A queue for a new viewer; APIError 429 when `cap` are open already."""
        queue: asyncio.Queue = asyncio.Queue(QUEUE)
        with self._lock:
            if len(self._open) >= self.cap:
                raise too_many_viewers(self.cap)
            self._open.append((asyncio.get_running_loop(), queue))
        return queue

    def remove(self, queue: asyncio.Queue) -> int:
        """Forget a viewer (its stream ended, however); how many are left."""
        with self._lock:
            self._open = [v for v in self._open if v[1] is not queue]
            return len(self._open)

    def __len__(self) -> int:
        return len(self._open)

    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the viewers live on (None without viewers)."""
        with self._lock:
            return self._open[0][0] if self._open else None

    def offer(self, item: Item) -> None:
        """One item to every viewer (from their event loop, or any other)."""
        with self._lock:
            viewers = list(self._open)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        for loop, queue in viewers:
            if loop is running:
                _offer(queue, item)
            else:
                loop.call_soon_threadsafe(_offer, queue, item)

    def close(self) -> None:
        """End every stream (any thread): the server is shutting down, and an open stream would hold its graceful
        shutdown for the whole timeout."""
        with self._lock:
            self.closed = True
            viewers = list(self._open)
        for loop, queue in viewers:
            loop.call_soon_threadsafe(_offer, queue, None)

    async def stream(self, queue: asyncio.Queue, hello: Callable[[], Awaitable[dict]]):
        """The SSE body of the viewer of `queue`: `event: hello` (from `hello()`), then the items offered, with a
        comment line as keep-alive while nothing comes. The response removes the viewer when the stream ends."""
        yield sse("hello", await hello())
        while not self.closed:
            try:
                item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except asyncio.TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if item is None:  # close(): the server is shutting down
                return
            yield sse(*item)


def _offer(queue: asyncio.Queue, item: Item | None) -> None:
    if queue.full():
        queue.get_nowait()  # the slow viewer loses its oldest batch
    queue.put_nowait(item)
