"""Work the async engine does off the event loop, on threads of its own rather than asyncio's shared default
executor (which the server's image and MP4 encodes use: requests waiting there for an adapter must not stall them).

Two small pools: `decisions` for admission decisions that cost time (slo replays the queue), which never wait on
an adapter load; `adapters` for what does (loading an adapter, the admissions that need one loaded, unloading one).
Requests waiting for an adapter are queued work items of one thread there, not threads each.

A call is shielded from the caller's cancellation: a call that had not started is dropped; one already running
finishes, and what it returns is handed to `undo` (the admission's handles are aborted), so a cancelled handler
never leaves requests running that nobody waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class OffLoop:
    def __init__(self) -> None:
        self.decisions = ThreadPoolExecutor(1, thread_name_prefix="stepserve-admission")
        self.adapters = ThreadPoolExecutor(1, thread_name_prefix="stepserve-adapters")

    async def run(self, pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any,
                  undo: Callable[[T], None] | None = None) -> T:
        """fn(*args) on `pool`, awaited; on cancellation the call is dropped if it has not started, else left to
        finish and its result passed to `undo` (in the pool's thread)."""
        call = pool.submit(fn, *args)
        try:
            return await asyncio.shield(asyncio.wrap_future(call))
        except asyncio.CancelledError:
            if not call.cancel() and undo is not None:
                call.add_done_callback(lambda done: _undo(done, undo))
            raise

    def close(self) -> None:
        """No more calls; those queued still run (an admission then answers that the engine is shutting down)."""
        for pool in (self.decisions, self.adapters):
            pool.shutdown(wait=False)


def _undo(done: Future, undo: Callable[[Any], None]) -> None:
    if not done.cancelled() and done.exception() is None and done.result() is not None:
        undo(done.result())
