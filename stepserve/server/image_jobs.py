"""Async image requests: `POST /v1/images/generations` or `/v1/images/edits` with the header `Prefer: respond-async`
answers 202 with a job (Location: /v1/images/jobs/{id}) once the request has passed every check the synchronous
request meets (a 400 makes no job). The job runs on whichever process of the service claims it (stepserve/jobs/);
its result is exactly the body the synchronous request would have answered (kept as a file in the results folder).

- GET /v1/images/jobs: the jobs kept, newest first (at most 100; without their results);
- GET /v1/images/jobs/{id}: {"id": "imgjob_...", "object": "image.job", "status", "progress", "created_at",
  "completed_at", "error", "result": null or the answer, "webhook": null or its delivery state};
- GET /v1/images/jobs/{id}/events: `image.queued`, `image.in_progress`, then `image.completed` or `image.failed`,
  each with the job (as videos' events: local changes, else the store read every 0.5 s);
- DELETE /v1/images/jobs/{id}: cancel (when unfinished) and forget it and its files.

The job stores the request as sent, with its seed (drawn at creation when none was given), and its pictures (an
edit's uploads, a generation's base64 control and image-prompt pictures: job_pictures.py) as input files in the
results folder, so that a rerun on any process makes the same images and the job's document stays small.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..jobs.kinds import JobError
from ..jobs.service import new_id
from ..request.types import GenerationResult, SamplingParams
from ..store.base import COMPLETED, JobRecord
from .edits import EditForm, edit_params
from .errors import APIError, invalid
from .images import image_body, resolve_all
from .job_pictures import put_pictures, take_pictures
from .job_http import (check_serving, check_streams, check_webhook, create_job, fingerprint, idempotency_key,
                       job_error, job_events, prefers_async, result_error, started_from)
from .schemas import body_from_fields, engine_params
from .controlnets import with_controls
from .state import ServerState
from .streaming import EventStreamResponse

JOBS = "/v1/images/jobs"


async def async_answer(state: ServerState, request: Request, path: str, req: Any, params: Sequence[SamplingParams],
                       sent: EditForm | None) -> Response | None:
    """With `Prefer: respond-async`: the job's answer (create_image_job); None for a synchronous request (which
    never touches the store; a webhook there is a 400)."""
    if prefers_async(request):
        return await create_image_job(state, request, path, req, params, sent)
    if req.webhook is not None:
        raise invalid("webhook: only a job notifies a webhook; send the request with the header 'Prefer: "
                      "respond-async' (or leave webhook out)", "webhook")
    return None


async def create_image_job(state: ServerState, request: Request, path: str, req: Any,
                           params: Sequence[SamplingParams], sent: EditForm | None) -> Response:
    """202 and the new job (200 and the job made earlier, for an Idempotency-Key seen before)."""
    if req.stream:
        raise invalid(f"stream: not with 'Prefer: respond-async'; follow the job's events instead ({JOBS}/{{id}}/"
                      f"events)", "stream")
    key = idempotency_key(request)
    check_serving(state)  # before any input file is written
    webhook = check_webhook(req.webhook, state.jobs.webhook_secret)
    resolved = await resolve_all(state, params)
    route = "edits" if sent is not None else "generations"
    body = dict(sent.fields) if sent is not None else req.model_dump(exclude_none=True)
    pictures = {} if sent is None else sent.pictures()  # image, mask and control images
    # (megabytes of pictures: hashed, and a generation's decoded, off the event loop)
    print_ = await asyncio.to_thread(fingerprint, {"route": route, "body": body,
                                                   "files": {k: hashlib.sha256(v).hexdigest()
                                                             for k, v in pictures.items()}})
    if sent is None:  # a generation's base64 pictures: input files too, not megabytes in the job's document
        body, pictures = await asyncio.to_thread(take_pictures, body)
    job_id = new_id("imgjob")
    results = state.jobs.results
    inputs = {role: f"{job_id}.{role}" for role in pictures}
    for role, data in pictures.items():
        await asyncio.to_thread(results.write, inputs[role], data)
    job = JobRecord(job_id, "image", {"route": route, "body": {**body, "seed": resolved[0].seed}, "inputs": inputs},
                    0.0, webhook=webhook, idempotency_key=None if key is None else f"image:{key}",
                    meta={"model": state.engine.model_info.name, "path": path})
    try:
        job, created = await create_job(state, job, print_, state.limits.max_image_jobs, "image jobs")
    except APIError as exc:  # refused: no job of these inputs exists (a store that failed may have made it: kept)
        if exc.code != "state_unavailable":
            await asyncio.to_thread(results.delete, inputs.values())
        raise
    # (a creation cancelled meanwhile, its client gone, leaves the inputs: the job may still be made in the store's
    # thread; if it was not, the sweep removes them by age)
    if not created:  # the job made earlier under this key has its own
        await asyncio.to_thread(results.delete, inputs.values())
    # RFC 7240: the preference was honoured (a synchronous answer carries no Preference-Applied, so a client whose
    # Prefer was misspelt, "respond-asynch", can tell)
    return JSONResponse(await image_job_object(state, job), status_code=202 if created else 200,
                        headers={"Location": f"{JOBS}/{job.id}", "Preference-Applied": "respond-async"})


async def image_job_object(state: ServerState, job: JobRecord, with_result: bool = True) -> dict[str, Any]:
    result = None
    if with_result and job.status == COMPLETED and job.results:
        data = await asyncio.to_thread(state.jobs.results.read, job.results[0])
        result = None if data is None else json.loads(data)
    shown = {"id": job.id, "object": "image.job", "status": job.status, "progress": job.progress,
             "created_at": int(job.created_at),
             "completed_at": None if job.completed_at is None else int(job.completed_at), "error": job.error}
    if with_result:
        shown["result"] = result
    shown["webhook"] = job.webhook
    return shown


class ImageKind:
    """Async image jobs, as the runner runs them (stepserve/jobs/kinds.py)."""

    name = event = "image"

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def params(self, job: JobRecord) -> list[SamplingParams]:
        state, body = self.state, job.request["body"]
        try:
            pictures = {}
            for role, name in (job.request.get("inputs") or {}).items():
                pictures[role] = await asyncio.to_thread(state.jobs.results.read, name)
                if pictures[role] is None:
                    raise JobError("input_missing", f"the job's {role} is no longer in the results folder (swept, or "
                                                    f"this server does not share the folder of the one that took "
                                                    f"the request)")
            if job.request["route"] != "edits":
                req = body_from_fields(put_pictures(body, pictures), state.limits)
                return await with_controls(req, engine_params(req, state.limits), state)  # controlnets.py
            _, params = await edit_params(EditForm.from_pictures(body, pictures), state)
            return params
        except APIError as exc:  # a request this server's model cannot make (a store shared with another model)
            raise job_error(exc) from None

    error_of = staticmethod(result_error)

    async def finish(self, job: JobRecord, results: Sequence[GenerationResult]) -> dict[str, bytes]:
        body = await image_body(self.state, results)
        return {f"{job.id}.{job.attempts}.json": json.dumps(body, separators=(",", ":")).encode()}  # per attempt

    async def describe(self, job: JobRecord) -> dict[str, Any]:
        return await image_job_object(self.state, job)

    def ended(self, job: JobRecord, outcome: str, results: Sequence[GenerationResult]) -> None:
        self.state.request_done(outcome, 202, started_from(job), results, job.meta.get("path", JOBS))


def image_job_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/images/jobs")
    async def listing() -> dict:
        jobs = await state.jobs.list("image")
        return {"object": "list", "data": [await image_job_object(state, j, with_result=False) for j in jobs]}

    @router.get("/images/jobs/{job_id}")
    async def status(job_id: str) -> dict:
        return await image_job_object(state, await _job(state, job_id))

    @router.get("/images/jobs/{job_id}/events")
    async def events(job_id: str) -> Response:
        job = await _job(state, job_id)
        check_streams(state)
        return EventStreamResponse(job_events(state, job, "image", lambda j: image_job_object(state, j)),
                                   lambda: None)

    @router.delete("/images/jobs/{job_id}")
    async def delete(job_id: str) -> dict:
        job = await state.jobs.delete("image", job_id)
        if job is None:
            raise _not_found(job_id)
        return {"id": job.id, "object": "image.job.deleted", "deleted": True}

    return router


async def _job(state: ServerState, job_id: str) -> JobRecord:
    job = await state.jobs.get("image", job_id)
    if job is None:
        raise _not_found(job_id)
    return job


def _not_found(job_id: str) -> APIError:
    return APIError(404, f"image job {job_id!r} is not here (never created, deleted, or swept after its results were "
                         f"kept for --keep-results-h hours)", code="image_job_not_found", param="job_id")
