"""Following a job's engine requests to their ends (jobs/attempt.py): their progress events merged into one
share of the job's steps done, written at most once per batch of events that piled up meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from ..engine.async_engine import ProgressEvent
from ..engine.handles import RequestHandle
from ..request.types import GenerationResult


async def follow_requests(handles: Sequence[RequestHandle], progress: Callable[[int], Awaitable[bool]],
                          abort: Callable[[], None]) -> list[GenerationResult] | None:
    """Every request's result, in order, calling `progress` (0-99) at each step; None when `progress` says the job
    was lost meanwhile; [the failed result] when a request failed (the others are then aborted)."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for item in handle.events():
            events.put_nowait((index, item))

    pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    done = [0.0] * len(handles)
    results: list[GenerationResult | None] = [None] * len(handles)
    try:
        while any(r is None for r in results):
            items = [await events.get()]
            while not events.empty():  # steps that piled up while the last write was made: one write for all
                items.append(events.get_nowait())
            stepped = False
            for index, item in items:
                if isinstance(item, ProgressEvent):
                    done[index] = item.step / max(1, item.num_inference_steps)
                    stepped = True
                else:
                    results[index] = item
                    done[index] = 1.0
                    if not item.ok:  # one failed: the job fails; the rest need not run
                        abort()
                        return [item]
            if stepped and any(r is None for r in results):
                if not await progress(min(99, int(100 * sum(done) / len(done)))):
                    return None
        return results  # type: ignore[return-value]
    finally:
        for p in pumps:
            p.cancel()
