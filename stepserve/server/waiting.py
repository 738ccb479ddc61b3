"""Waiting for results while watching the client: a client that goes away aborts its requests in the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from ..api import GenerationResult
from ..async_engine import RequestHandle
from ..types import SamplingParams
from . import errors
from .state import ServerState
from .submission import abort_all

Receive = Callable[[], Awaitable[dict]]


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone away (the request body must have been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def backstop_s(params: Sequence[SamplingParams]) -> float | None:
    """How long the HTTP side waits at most. The engine enforces timeout_s itself (it wakes at deadlines); this
    only covers a step that overruns the deadline by far."""
    timeout = params[0].timeout_s if params else None
    return None if timeout is None else timeout + max(1.0, 0.25 * timeout)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def wait_all(state: ServerState, handles: list[RequestHandle], receive: Receive,
                   timeout_s: float | None) -> list[GenerationResult] | None:
    """All results in order, or None when the client disconnected first (its requests are then aborted)."""
    results = asyncio.ensure_future(asyncio.gather(*(h.result() for h in handles)))
    results.add_done_callback(_retrieve)  # once cancelled, its CancelledError is nobody's to read: no log noise
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({results, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if results in done:
        return results.result()
    results.cancel()
    abort_all(state.engine, handles)
    if watcher in done:
        return None
    raise errors.deadline_passed(handles[0].params.timeout_s or 0.0, "the engine did not answer in time")
