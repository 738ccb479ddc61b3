"""The videos endpoint, OpenAI-style, for a video model (Wan). Jobs live in the state store, so any process that
shares it answers for any job (the request, the job kind and the video object: video_jobs.py; running them:
stepserve/jobs/):

- POST /v1/videos: create a job -> the video object, status "queued" (the request is checked first: a 400 makes
  no job); with "stream": true, the job's events instead (as GET .../events). `Idempotency-Key` returns the job
  made earlier under the key; `webhook` names a URL told once when the job completes or fails;
- GET /v1/videos: the jobs kept, newest first (at most 100); GET /v1/videos/{id}: the video object;
- GET /v1/videos/{id}/content: the MP4 once completed, from the results folder (HTTP Range served);
- GET /v1/videos/{id}/events: server-sent events, one per change (`video.queued`, `video.in_progress` with
  progress, then `video.completed` or `video.failed`), each carrying the video object; from this process's own
  changes when the job runs here, else read from the store every 0.5 s. Leaving the stream does not cancel the
  job; DELETE does;
- DELETE /v1/videos/{id}: cancel (when unfinished: where it runs, within two of its steps) and forget it and its
  MP4.

A job becomes one engine request of num_frames frames (from num_frames, or seconds x fps rounded to what the model
makes, or the model's default), in the same batches as other requests of its (frames, height, width) bucket.
Waiting or running jobs of the whole service are bounded (ServerLimits.max_video_jobs): beyond that, 429.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.requests import ClientDisconnect

from ..jobs.service import new_id
from ..store.base import COMPLETED, JobRecord
from . import errors
from .bodies import check_json, read_body
from .forms import is_form
from .images import outcome_of, resolve_all
from .job_http import check_streams, check_webhook, create_job, fingerprint, idempotency_key, job_events
from .mp4 import EncoderMissing, check_encoder
from .schemas import check_model
from .state import CLIENT_GONE, ServerState
from .streaming import EventStreamResponse
from .video_jobs import parse_video_body, read_video_form, video_meta, video_object, video_params


def video_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/videos")
    async def create(request: Request) -> Response:
        started = time.monotonic()
        try:
            key = idempotency_key(request)
            if is_form(request):  # as the official clients send it
                req = await read_video_form(request, state)
            else:
                check_json(request, also="or multipart/form-data")
                req = parse_video_body(await read_body(request, state.limits.max_body_bytes))
            check_model(req.model, state.engine.model_info.name, state.limits)  # 404 for a model not served here
            params, fps = video_params(req, state.engine.model_info, state.limits.default_timeout_s)
            webhook = check_webhook(req.webhook, state.jobs.webhook_secret)
            try:
                check_encoder()  # before any work: a server without the video extra cannot answer with an MP4
            except EncoderMissing as exc:
                raise errors.APIError(501, str(exc), type="server_error", code="video_encoder_missing") from None
            resolved, = await resolve_all(state, [params])  # the checks an engine request meets (400s), and the seed
            sent = req.model_dump(exclude_none=True)
            job = JobRecord(new_id("video"), "video", {"body": {**sent, "seed": resolved.seed}}, 0.0,
                            webhook=webhook, idempotency_key=None if key is None else f"video:{key}",
                            meta=video_meta(state.engine.model_info.name, resolved, fps))
            job, created = await create_job(state, job, fingerprint(sent), state.limits.max_video_jobs,
                                            "video jobs")
        except errors.APIError as exc:  # refused at once: its metrics and access-log line now (a job's: at its end)
            state.video_done(outcome_of(exc), exc.status, started)
            raise
        except ClientDisconnect:
            state.video_done("cancelled", CLIENT_GONE, started)
            return Response(status_code=CLIENT_GONE)
        except asyncio.CancelledError:  # the handler cancelled (Ray Serve when the client goes away)
            state.video_done("cancelled", CLIENT_GONE, started)
            raise
        except Exception:  # answered 500 by the app's last resort; counted here all the same
            state.video_done("failed", 500, started)
            raise
        if req.stream:
            return EventStreamResponse(_events(state, job), lambda: None)
        return JSONResponse(video_object(job))

    @router.get("/videos")
    async def listing() -> dict:
        return {"object": "list", "data": [video_object(j) for j in await state.jobs.list("video")]}

    @router.get("/videos/{video_id}")
    async def status(video_id: str) -> dict:
        return video_object(await _job(state, video_id))

    @router.get("/videos/{video_id}/content")
    async def content(video_id: str) -> Response:
        job = await _job(state, video_id)
        if job.status != COMPLETED:
            raise errors.APIError(409, f"video {video_id!r} is {job.status}; its content exists once it is "
                                       f"completed (GET /v1/videos/{video_id} says when)", code="video_not_ready")
        path = state.jobs.results.path(job.results[0])
        if not await asyncio.to_thread(path.is_file):
            raise errors.APIError(404, f"the MP4 of video {video_id!r} is not in the results folder (swept, or this "
                                       f"server does not share the folder of the one that made it)",
                                  code="video_content_missing", param="video_id")
        return FileResponse(path, media_type="video/mp4")  # answers Range requests itself (206)

    @router.get("/videos/{video_id}/events")
    async def events(video_id: str) -> Response:
        job = await _job(state, video_id)
        check_streams(state)
        return EventStreamResponse(_events(state, job), lambda: None)

    @router.delete("/videos/{video_id}")
    async def delete(video_id: str) -> dict:
        job = await state.jobs.delete("video", video_id)
        if job is None:
            raise _not_found(video_id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    return router


async def _job(state: ServerState, video_id: str) -> JobRecord:
    job = await state.jobs.get("video", video_id)
    if job is None:
        raise _not_found(video_id)
    return job


def _not_found(video_id: str) -> errors.APIError:
    return errors.APIError(404, f"video {video_id!r} is not here (never created, deleted, or swept after its results "
                                f"were kept for --keep-results-h hours)", code="video_not_found", param="video_id")


def _events(state: ServerState, job: JobRecord):
    async def describe(record: JobRecord) -> dict:
        return video_object(record)

    return job_events(state, job, "video", describe)
