"""The videos endpoint, OpenAI-style, for a video model (Wan):

- POST /v1/videos: create a job (a JSON body, VideoRequest, or the same fields as a multipart form, as the official
  clients send it) -> the video object, status "queued"; with
  "stream": true, the job's events instead (as GET .../events);
- GET /v1/videos: the kept jobs, newest first; GET /v1/videos/{id}: the video object (status, progress 0-100);
- GET /v1/videos/{id}/content: the MP4 once completed;
- GET /v1/videos/{id}/events: server-sent events, one per change (`video.queued`, `video.in_progress` with
  progress, then `video.completed` or `video.failed`), each carrying the video object. Leaving the stream does not
  cancel the job; DELETE does;
- DELETE /v1/videos/{id}: cancel (when unfinished) and forget.

A request becomes one engine request of num_frames frames (from num_frames, or seconds x fps rounded to what the
model makes, or the model's default), admitted as an image request is (400 for bad input, 429 with Retry-After when
the queue is full), in the same batches as other requests of its (frames, height, width) bucket. Jobs: video_jobs.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile
from starlette.requests import ClientDisconnect

from ..request.types import ModelInfo, SamplingParams
from ..request.validation import MAX_SEED
from . import errors
from .bodies import check_json, from_fields, parse_object, read_body
from .errors import invalid
from .forms import bounded_form, form_fields, is_form
from .images import outcome_of, submit_all
from .state import CLIENT_GONE, ServerState
from .mp4 import EncoderMissing, check_encoder
from .schemas import request_size
from .streaming import EventStreamResponse, sse
from .video_jobs import VideoJob, VideoJobs, event_name

MAX_FPS = 60
NO_REFERENCE = "input_reference: image to video is not served; allowed: text to video (leave it out)"
_TEXT = {"prompt", "model", "size", "seconds", "input_reference", "user", "negative_prompt", "sampler"}  # never parsed


class VideoRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # OpenAI fields (seconds: a string there, "4"; a number is taken too)
    prompt: str
    model: str | None = None
    size: str | None = None
    seconds: str | int | float | None = None
    input_reference: str | None = None
    user: str | None = None
    # stepserve fields
    num_frames: int | None = None
    fps: int | None = None
    stream: bool | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    sampler: str | None = None
    timeout_s: float | None = None
    priority: int | None = None


def parse_video_body(raw: bytes) -> VideoRequest:
    """Strict, as the images body: a JSON object of VideoRequest's fields, or a 400 naming what is wrong."""
    return parse_object(raw, VideoRequest, '{"prompt": "a red fox running", "size": "832x480", "seconds": "5"}')


async def read_video_form(request: Request, state: ServerState) -> VideoRequest:
    """The same request as a multipart form (what openai's client.videos.create sends), read within the server's
    upload limits (forms.py): text fields as they are, the others as JSON (`num_frames=5`, `stream=true`)."""
    async with bounded_form(request, state, max_files=1) as form:
        if isinstance(form.get("input_reference"), UploadFile):
            raise invalid(NO_REFERENCE, "input_reference")
        fields = form_fields(form, _TEXT, (), "none (input_reference, an image, is not served)")
    return from_fields(fields, VideoRequest)


def video_params(req: VideoRequest, model: ModelInfo, default_timeout_s: float | None) -> tuple[SamplingParams, int]:
    """(the engine request, frames per second). Frames: num_frames, else seconds x fps to the nearest length the
    model makes (1 + a multiple of frame_step), else the model's default."""
    if not model.video:
        raise invalid(f"model: {model.name} ({model.family} family) makes images, not videos; /v1/videos needs a "
                      f"video model (wan); use /v1/images/generations", "model", "model_not_video")
    if req.input_reference is not None:
        raise invalid(NO_REFERENCE, "input_reference")
    fps = model.default_fps if req.fps is None else req.fps
    if not 1 <= fps <= MAX_FPS:
        raise invalid(f"fps: must be an integer from 1 to {MAX_FPS}, got {fps}", "fps")
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise invalid(f"seed: must be an integer in [0, {MAX_SEED}], got {req.seed}", "seed")
    frames = req.num_frames
    if req.seconds is not None:
        if frames is not None:
            raise invalid("seconds: give seconds or num_frames, not both", "seconds")
        frames = frames_for(req.seconds, fps, model)
    width, height = request_size(req.size)
    return SamplingParams(
        prompt=req.prompt, negative_prompt=req.negative_prompt or "", seed=req.seed,
        num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale, sampler=req.sampler,
        height=height, width=width, num_frames=model.default_frames if frames is None else frames,
        timeout_s=req.timeout_s if req.timeout_s is not None else default_timeout_s, priority=req.priority), fps


def frames_for(seconds: str | int | float, fps: int, model: ModelInfo) -> int:
    longest = f"{(model.max_frames - 1) / fps:g}"
    try:
        value = float(seconds)
    except (ValueError, OverflowError):  # not a number, or an integer too large for a float
        value = float("nan")
    if not 0 <= value <= (model.max_frames - 1) / fps:
        raise invalid(f"seconds: must be a number from 0 to {longest} ({model.max_frames} frames at {fps} fps), got "
                      f"{seconds!r}", "seconds")
    step = model.frame_step
    return 1 + step * round(value * fps / step)


def video_routes(state: ServerState, jobs: VideoJobs) -> APIRouter:
    router = APIRouter()

    @router.post("/videos")
    async def create(request: Request) -> Response:
        started = time.monotonic()
        try:
            if is_form(request):  # as the official clients send it
                req = await read_video_form(request, state)
            else:
                check_json(request, also="or multipart/form-data")
                req = parse_video_body(await read_body(request, state.limits.max_body_bytes))
            params, fps = video_params(req, state.engine.model_info, state.limits.default_timeout_s)
            try:
                check_encoder()  # before any work: a server without the video extra cannot answer with an MP4
            except EncoderMissing as exc:
                raise errors.APIError(501, str(exc), type="server_error", code="video_encoder_missing") from None
            jobs.make_room()
            handle, = await submit_all(state, [params], stream=True)
        except errors.APIError as exc:  # refused at once: its metrics and access-log line now (a job's: at its end)
            state.video_done(outcome_of(exc), exc.status, started)
            raise
        except ClientDisconnect:
            state.video_done("cancelled", CLIENT_GONE, started)
            return Response(status_code=CLIENT_GONE)
        except asyncio.CancelledError:  # the handler cancelled (Ray Serve when the client goes away): what its
            state.video_done("cancelled", CLIENT_GONE, started)  # admission accepted is aborted by the engine
            raise
        except Exception:  # answered 500 by the app's last resort; counted here all the same
            state.video_done("failed", 500, started)
            raise
        job = jobs.start(handle, fps, started)
        if req.stream:
            return EventStreamResponse(job_events(job), lambda: None)
        return JSONResponse(job.body())

    @router.get("/videos")
    async def listing() -> dict:
        return {"object": "list", "data": [j.body() for j in reversed(jobs.jobs.values())]}

    @router.get("/videos/{video_id}")
    async def status(video_id: str) -> dict:
        return jobs.get(video_id).body()

    @router.get("/videos/{video_id}/content")
    async def content(video_id: str) -> Response:
        job = jobs.get(video_id)
        if job.status != "completed":
            raise errors.APIError(409, f"video {video_id!r} is {job.status}; its content exists once it is "
                                       f"completed (GET /v1/videos/{video_id} says when)", code="video_not_ready")
        return Response(job.mp4, media_type="video/mp4")

    @router.get("/videos/{video_id}/events")
    async def events(video_id: str) -> Response:
        return EventStreamResponse(job_events(jobs.get(video_id)), lambda: None)

    @router.delete("/videos/{video_id}")
    async def delete(video_id: str) -> dict:
        job = jobs.delete(video_id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    return router


async def job_events(job: VideoJob) -> AsyncIterator[bytes]:
    """The job as it is now, then every change, until it is finished."""
    queue: asyncio.Queue = asyncio.Queue()
    job.listeners.append(queue)
    try:
        body = job.body()
        while True:
            yield sse(event_name(body), body)
            if body["status"] in ("completed", "failed"):
                return
            body = await queue.get()
    finally:
        job.listeners.remove(queue)
