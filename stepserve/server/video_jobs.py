"""Video jobs: the request of POST /v1/videos (a JSON body, VideoRequest, or the same fields as a multipart form, as
the official clients send it), how it becomes one engine request, and the video kind of job the runner runs
(stepserve/jobs/): its engine request from the stored request, its MP4 (made off the event loop) as the job's
result file, and the OpenAI video object it is shown as.

A job stores its request as the client sent it, with the seed (drawn at creation when the client gave none), so a
rerun on any process makes the same video. Its resolved settings (size, frames, fps, steps, sampler, guidance)
are kept in the job's meta for the video object. Its status goes queued -> in_progress (progress: the share of its
denoising steps done, 0-99) -> completed (100; the MP4 in the results folder) or failed (error {"code",
"message"}). Every job's end is told once, by the process that ran it, to the server's metrics and access log
(ServerState.video_done).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile

from ..jobs.kinds import JobError
from ..request.types import GenerationResult, ModelInfo, SamplingParams
from ..request.validation import MAX_SEED
from ..store.base import JobRecord
from .bodies import from_fields, parse_object
from .errors import APIError, invalid
from .forms import bounded_form, form_fields
from .job_http import job_error, result_error, started_from
from .mp4 import EncoderMissing, encode_mp4
from .schemas import request_size
from .state import ServerState

MAX_FPS = 60
NO_REFERENCE = "input_reference: image to video is not served; allowed: text to video (leave it out)"
_TEXT = {"prompt", "model", "size", "seconds", "input_reference", "user", "negative_prompt", "sampler",
         "webhook"}  # never parsed


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
    webhook: str | None = None  # notified once when the job completes or fails


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


def seconds_text(frames: int, fps: int) -> str:
    """A video's length as OpenAI writes `seconds` (a string): '5' for 81 frames at 16 fps, '0.25' for 5."""
    return f"{(frames - 1) / fps:g}"


def video_meta(model: str, p: SamplingParams, fps: int) -> dict[str, Any]:
    """What the video object shows of a job's resolved request (kept in the job's meta)."""
    return {"model": model, "video": {"width": p.width, "height": p.height, "num_frames": p.num_frames, "fps": fps,
                                      "seed": p.seed, "num_inference_steps": p.num_inference_steps,
                                      "sampler": p.sampler, "guidance_scale": p.guidance_scale}}


def video_object(job: JobRecord) -> dict[str, Any]:
    """The OpenAI video object, with stepserve's details of the request under "stepserve"."""
    v = job.meta["video"]
    ids = job.meta.get("request_ids") or [None]
    details = {"num_frames": v["num_frames"], "fps": v["fps"], "seed": v["seed"],
               "num_inference_steps": v["num_inference_steps"], "sampler": v["sampler"],
               "guidance_scale": v["guidance_scale"], "request_id": ids[0]}
    if job.webhook:
        details["webhook"] = job.webhook
    return {"id": job.id, "object": "video", "created_at": int(job.created_at), "status": job.status,
            "progress": job.progress, "model": job.meta["model"], "size": f"{v['width']}x{v['height']}",
            "seconds": seconds_text(v["num_frames"], v["fps"]),
            "completed_at": None if job.completed_at is None else int(job.completed_at), "error": job.error,
            "stepserve": details}


class VideoKind:
    """Video jobs, as the runner runs them (stepserve/jobs/kinds.py)."""

    name = event = "video"

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def params(self, job: JobRecord) -> list[SamplingParams]:
        try:
            req = from_fields(job.request["body"], VideoRequest)
            params, _ = video_params(req, self.state.engine.model_info, self.state.limits.default_timeout_s)
        except APIError as exc:  # a request this server's model cannot make (a store shared with another model)
            raise job_error(exc) from None
        return [params]

    error_of = staticmethod(result_error)

    async def finish(self, job: JobRecord, results: Sequence[GenerationResult]) -> dict[str, bytes]:
        try:
            mp4 = await asyncio.to_thread(encode_mp4, results[0].frames, job.meta["video"]["fps"])
        except EncoderMissing as exc:
            raise JobError("video_encoder_missing", str(exc)) from None
        return {f"{job.id}.{job.attempts}.mp4": mp4}  # per attempt (jobs/attempt.py)

    async def describe(self, job: JobRecord) -> dict[str, Any]:
        return video_object(job)

    def ended(self, job: JobRecord, outcome: str, results: Sequence[GenerationResult]) -> None:
        self.state.video_done(outcome, 200, started_from(job), results[0] if results else None, job.id)
