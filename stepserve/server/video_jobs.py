"""Video jobs (POST /v1/videos): one engine request each, followed in the background, kept in memory.

A job is created once its request is admitted (a refused request makes no job). A task follows the request's
progress events: `queued` until its first denoising step, then `in_progress` with `progress` (0-99, the share of
its steps done; 100 once the MP4 is made), and at the end `completed` (the MP4 is encoded off the event loop and
kept) or `failed` with the error. Listeners (the event stream) hear every change. At most `max_jobs` are kept: a new
job drops the oldest finished one, and when every kept job is still running the new one is refused (429).
DELETE cancels a job that has not finished (its request is aborted in the engine) and forgets it. Every job's end
(completed, failed with the error's outcome, cancelled, or cut short by shutdown) is told to `on_end` once: the
server's metrics and access log.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.async_engine import AsyncEngine, ProgressEvent, RequestHandle
from ..request.types import GenerationResult, SamplingParams
from . import errors
from .errors import APIError
from .images import check, outcome_of
from .mp4 import encode_mp4

log = logging.getLogger("stepserve.server")
FINISHED = ("completed", "failed")


def seconds_text(frames: int, fps: int) -> str:
    """A video's length as OpenAI writes `seconds` (a string): '5' for 81 frames at 16 fps, '0.25' for 5."""
    return f"{(frames - 1) / fps:g}"


@dataclass(eq=False)
class VideoJob:
    id: str
    model: str
    params: SamplingParams  # resolved
    fps: int
    started: float = field(default_factory=time.monotonic)  # time.monotonic() at the request's arrival
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: str = "queued"
    progress: int = 0
    error: dict | None = None
    completed_at: int | None = None
    mp4: bytes | None = None
    handle: RequestHandle | None = None
    task: asyncio.Task | None = field(default=None, repr=False)
    listeners: list[asyncio.Queue] = field(default_factory=list, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def body(self) -> dict:
        """The OpenAI video object, with stepserve's details of the request under "stepserve"."""
        p = self.params
        return {"id": self.id, "object": "video", "created_at": self.created_at, "status": self.status,
                "progress": self.progress, "model": self.model, "size": f"{p.width}x{p.height}",
                "seconds": seconds_text(p.num_frames, self.fps), "completed_at": self.completed_at,
                "error": self.error,
                "stepserve": {"num_frames": p.num_frames, "fps": self.fps, "seed": p.seed,
                              "num_inference_steps": p.num_inference_steps, "sampler": p.sampler,
                              "guidance_scale": p.guidance_scale,
                              "request_id": None if self.handle is None else self.handle.request_id}}

    def changed(self) -> None:
        for q in self.listeners:
            q.put_nowait(self.body())


class VideoJobs:
    """The jobs this server keeps (see the module docstring), newest last."""

    def __init__(self, engine: AsyncEngine, max_jobs: int = 64,
                 on_end: Callable[[VideoJob, str, GenerationResult | None], None] | None = None) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be >= 1, got {max_jobs}")
        self.engine = engine
        self.max_jobs = max_jobs
        self.on_end = on_end  # (job, outcome, its result when it has one), once per job
        self.jobs: OrderedDict[str, VideoJob] = OrderedDict()

    def make_room(self) -> None:
        """Drop the oldest finished job when the store is full; a 429 when every kept job is still running."""
        if len(self.jobs) < self.max_jobs:
            return
        oldest = next((j for j in self.jobs.values() if j.finished), None)
        if oldest is None:
            raise errors.queue_full(f"{self.max_jobs} video jobs are still running here, the most this server "
                                    f"keeps; retry once one finishes", 5)
        del self.jobs[oldest.id]

    def start(self, handle: RequestHandle, fps: int, started: float | None = None) -> VideoJob:
        """A job for an admitted request (that arrived at `started`, time.monotonic()); its follower task starts
        now."""
        job = VideoJob(f"video_{secrets.token_hex(12)}", self.engine.model_info.name, handle.params, fps,
                       started=time.monotonic() if started is None else started, handle=handle)
        self.jobs[job.id] = job
        job.task = asyncio.ensure_future(self._follow(job))
        return job

    def get(self, video_id: str) -> VideoJob:
        job = self.jobs.get(video_id)
        if job is None:
            raise APIError(404, f"video {video_id!r} is not here (never created, deleted, or dropped as one of the "
                                f"oldest finished of the {self.max_jobs} this server keeps)",
                           code="video_not_found", param="video_id")
        return job

    def delete(self, video_id: str) -> VideoJob:
        job = self.get(video_id)
        del self.jobs[video_id]
        if not job.finished:
            if job.handle is not None:
                self.engine.abort(job.handle.request_id)
            if job.task is not None:
                job.task.cancel()
            self._fail(job, "cancelled", "the video was deleted before it finished", "cancelled")
        return job

    async def close(self, wait_s: float = 5.0) -> None:
        """At shutdown, once the engine has ended its requests: let the followers take their results (and make the
        MP4 of a video that finished) for up to `wait_s`, then stop them; a job not finished by then ends as cut
        short."""
        following = [job.task for job in self.jobs.values() if job.task is not None and not job.task.done()]
        if following:
            await asyncio.wait(following, timeout=wait_s)
        for job in self.jobs.values():
            if job.task is not None:
                job.task.cancel()
            if not job.finished:
                self._fail(job, "shutting_down", "the server shut down before the video finished", "shutting_down")

    async def _follow(self, job: VideoJob) -> None:
        handle = job.handle
        try:
            async for item in handle.events():
                if isinstance(item, ProgressEvent):
                    job.status = "in_progress"
                    job.progress = min(99, int(100 * item.step / max(1, item.num_inference_steps)))
                    job.changed()
                else:
                    await self._finish(job, item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a job fails alone; the server serves on
            log.exception("video job %s failed", job.id)
            self._fail(job, "internal_error", f"{type(exc).__name__}: {exc}", "failed")

    async def _finish(self, job: VideoJob, result: GenerationResult) -> None:
        try:
            check(result)
        except APIError as exc:
            self._fail(job, exc.code or "failed", exc.message, outcome_of(exc), result)
            return
        job.status, job.progress = "in_progress", 99
        job.mp4 = await asyncio.to_thread(encode_mp4, result.frames, job.fps)
        job.status, job.progress, job.completed_at = "completed", 100, int(time.time())
        job.changed()
        self._ended(job, "completed", result)

    def _fail(self, job: VideoJob, code: str, message: str, outcome: str,
              result: GenerationResult | None = None) -> None:
        job.status, job.error, job.completed_at = "failed", {"code": code, "message": message}, int(time.time())
        job.changed()
        self._ended(job, outcome, result)

    def _ended(self, job: VideoJob, outcome: str, result: GenerationResult | None) -> None:
        if self.on_end is not None:
            try:
                self.on_end(job, outcome, result)
            except Exception:  # noqa: BLE001 - bookkeeping never fails a job
                log.exception("recording the end of video job %s failed", job.id)


def event_name(body: dict[str, Any]) -> str:
    return f"video.{body['status']}"
