"""What a caller of the async engine holds: a RequestHandle per submitted request (its result, and for a streaming
submit its progress events), the errors submit() raises, and how results and events are handed to the caller's
event loop (these run on that loop, called from the engine thread with call_soon_threadsafe)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..request.types import FinishReason, GenerationResult, RequestStatus, RequestTiming, SamplingParams

EVENT_QUEUE_BOUND = 32  # progress events kept for a slow stream reader; previews and results are never dropped


class ShuttingDownError(RuntimeError):
    """The engine no longer accepts requests."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; nothing more can run in this engine."""


@dataclass
class ProgressEvent:
    request_id: str
    step: int  # denoising steps done
    num_inference_steps: int
    preview: Any = None  # a PIL image of the current latents, at the steps the caller asked previews for


@dataclass
class RequestHandle:
    request_id: str
    params: SamplingParams  # resolved
    arrival: float  # on the engine's clock
    preview_steps: frozenset[int] = frozenset()
    stream: bool = False  # progress events are posted only for streaming handles
    _future: asyncio.Future = field(default=None, repr=False)  # type: ignore[assignment]
    _events: asyncio.Queue | None = field(default=None, repr=False)

    async def result(self) -> GenerationResult:
        return await asyncio.shield(self._future)

    async def events(self) -> AsyncIterator[ProgressEvent | GenerationResult]:
        """Progress events, then the final GenerationResult. Only for handles submitted with stream=True."""
        if self._events is None:
            raise RuntimeError("progress events need submit(..., stream=True); use result() otherwise")
        while True:
            item = await self._events.get()
            yield item
            if isinstance(item, GenerationResult):
                return


def ended_result(handle: RequestHandle, status: RequestStatus, reason: FinishReason,
                 message: str) -> GenerationResult:
    return GenerationResult(handle.request_id, status, None, handle.params, RequestTiming(arrival=handle.arrival),
                            reason, message)


def failed_result(handle: RequestHandle, message: str) -> GenerationResult:
    return ended_result(handle, RequestStatus.FAILED, FinishReason.ERROR, message)


def set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def post_event(queue: asyncio.Queue, event: ProgressEvent) -> None:
    """Runs on the event loop. A reader that falls behind loses plain progress events (the next one supersedes
    them), never a preview."""
    if event.preview is None and queue.qsize() >= EVENT_QUEUE_BOUND:
        return
    queue.put_nowait(event)
