"""Server-sent events for `"stream": true`: partial images while denoising, then one completed event per image.

The event payloads follow the OpenAI image-streaming shape (image_generation.partial_image /
image_generation.completed); stepserve details ride along under "stepserve". The response watches the client:
when it goes away, every request of the stream is aborted inside the engine at once, freeing its slot by the
next engine step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.responses import Response

from ..engine.async_engine import ProgressEvent, RequestHandle
from ..request.types import GenerationResult
from .errors import APIError, deadline_passed
from .state import ServerState
from .images import abort_all, check, encode, image_info, outcome_of, size_of, wait_disconnect

_OPENAI_FIXED = {"background": "opaque", "output_format": "png", "quality": "auto"}
_NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}, "output_tokens": 0,
             "total_tokens": 0}


def sse(event: str, data: dict | list | str) -> bytes:
    """One Server-Sent Event, the only framing the server writes: `data` as compact JSON, or a str that already is
    JSON (the console's batches, serialized once for every viewer)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"event: {event}\ndata: {text}\n\n".encode()


class EventStreamResponse(Response):
    """Streams `chunks`; stops as soon as the client disconnects. `on_close` runs once the stream is over, however
    it ended."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.chunks = chunks
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        iterator = self.chunks.__aiter__()
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                following = asyncio.ensure_future(iterator.__anext__())
                done, _ = await asyncio.wait({following, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if following not in done:
                    following.cancel()
                    await asyncio.gather(following, return_exceptions=True)
                    return
                try:
                    chunk = following.result()
                except StopAsyncIteration:
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we were writing
            pass
        finally:
            watcher.cancel()
            await _close(iterator)
            self.on_close()


async def _close(iterator) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except RuntimeError:  # still running in the cancelled task: it finishes on its own
            pass


@dataclass
class StreamJob:
    """The bookkeeping of one streamed request; close() is idempotent and aborts whatever did not finish."""

    state: ServerState
    handles: list[RequestHandle]
    started: float  # time.monotonic() at arrival
    path: str  # the route it came on: generations or edits (the access log's)
    outcome: str = "cancelled"
    results: list = field(default_factory=list)  # the images completed so far (GenerationResults)
    finished: bool = False  # every image completed
    closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            abort_all(self.state.engine, self.handles)
        self.state.inflight -= 1
        self.state.request_done(self.outcome, 200, self.started, self.results, self.path)


async def image_events(job: StreamJob, deadline_s: float | None) -> AsyncIterator[bytes]:
    """Merge the event streams of n images into SSE chunks. Ends after every image completed, or at the first
    failure (as an `error` event; the other images are aborted)."""
    handles = job.handles
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        async for item in handle.events():
            queue.put_nowait((index, item))

    pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    partial_index = [0] * len(handles)
    remaining = len(handles)
    give_up_at = None if deadline_s is None else time.monotonic() + deadline_s
    try:
        while remaining:
            wait = None if give_up_at is None else max(0.0, give_up_at - time.monotonic())
            try:
                index, item = await asyncio.wait_for(queue.get(), wait)
            except asyncio.TimeoutError:
                job.outcome = "timeout"
                yield sse("error", _error_event(deadline_passed(handles[0].params.timeout_s or 0.0,
                                                                "the engine did not answer in time")))
                return
            handle = handles[index]
            if isinstance(item, ProgressEvent):
                if item.preview is None:
                    continue
                yield sse("image_generation.partial_image", {
                    "type": "image_generation.partial_image", "b64_json": await encode(item.preview),
                    "partial_image_index": partial_index[index], "created_at": int(time.time()),
                    "size": size_of(handle.params), **_OPENAI_FIXED,
                    "stepserve": {"image_index": index, "step": item.step, "num_inference_steps": item.num_inference_steps},
                })
                partial_index[index] += 1
                continue
            result: GenerationResult = item
            try:
                check(result)
            except APIError as exc:
                job.outcome = outcome_of(exc)
                yield sse("error", _error_event(exc))
                return
            remaining -= 1
            job.results.append(result)
            job.state.note_latency(result.timing.total_s or 0.0)
            if not remaining:
                job.finished = True
                job.outcome = "completed"
            yield sse("image_generation.completed", {
                "type": "image_generation.completed", "b64_json": await encode(result.image),
                "created_at": int(time.time()), "size": size_of(result.params), **_OPENAI_FIXED,
                "usage": _NO_USAGE, "stepserve": {"image_index": index, **image_info(result)},
            })
    finally:
        for p in pumps:
            p.cancel()
        job.close()


def _error_event(exc: APIError) -> dict:
    return {"type": "error", **exc.body()}
