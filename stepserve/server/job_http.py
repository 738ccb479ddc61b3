"""What the job routes share (videos.py, image_jobs.py): the `Idempotency-Key` header, the `webhook` field,
`Prefer: respond-async`, creating a job (its bound: 429; a key reused for another body: 409; a server that is
draining or whose engine stopped: 503, as the synchronous request answers), and a job's events as server-sent
events.

- Idempotency-Key: at most 255 printable ASCII characters. A creation that carries one returns the job made
  earlier under the same key (scoped per kind of job) instead of a second job, as long as that job is kept; the
  same key with a different request is a 409.
- webhook: an http(s) URL of at most 2048 characters; the job then notifies it once when it completes or fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

from fastapi import Request

from ..jobs.kinds import JobError
from ..jobs.service import TooManyUnfinished
from ..jobs.targets import WebhookTargetError
from ..jobs.webhooks import WebhookSecretError, park, require_secret
from ..request.types import GenerationResult
from ..store.base import JobRecord
from . import errors
from .errors import APIError, invalid
from .images import check, outcome_of
from .state import ServerState
from .streaming import sse

log = logging.getLogger("stepserve.server")
IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
MAX_WEBHOOK_CHARS = 2048
_PRINTABLE = re.compile(r"[\x20-\x7e]+")


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not _PRINTABLE.fullmatch(key) or len(key) > MAX_KEY_CHARS:
        raise invalid(f"{IDEMPOTENCY_HEADER}: must be 1 to {MAX_KEY_CHARS} printable ASCII characters, got "
                      f"{len(key)} characters{'' if _PRINTABLE.fullmatch(key or ' ') else ' with others among them'}",
                      IDEMPOTENCY_HEADER, "invalid_idempotency_key")
    return key


def prefers_async(request: Request) -> bool:
    """`Prefer: respond-async` (RFC 7240: preferences separated by commas, names without case)."""
    prefer = request.headers.get("prefer", "")
    return any(p.split(";", 1)[0].split("=", 1)[0].strip().lower() == "respond-async" for p in prefer.split(","))


def check_webhook(url: str | None, secret: str | None) -> dict[str, Any] | None:
    """The job's webhook state for a valid `webhook` field (None when there is none); a 400 otherwise, and on a
    server without a webhook secret (nothing is sent unsigned)."""
    if url is None:
        return None
    allowed = f"allowed: an http:// or https:// URL of at most {MAX_WEBHOOK_CHARS} characters"
    if len(url) > MAX_WEBHOOK_CHARS:
        raise invalid(f"webhook: {len(url)} characters; {allowed}", "webhook", "invalid_webhook")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        host = None
    if parts.scheme not in ("http", "https") or not host or not _PRINTABLE.fullmatch(url) or " " in url:
        raise invalid(f"webhook: {url[:80]!r} is not a valid URL; {allowed}", "webhook", "invalid_webhook")
    try:
        require_secret(secret)
    except WebhookSecretError as exc:
        raise invalid(str(exc), "webhook", "webhook_secret_missing") from None
    return {"url": url, "state": "pending", "attempts": 0, "last_error": None, "delivered_at": None}


def fingerprint(request: Any) -> str:
    """What makes two creations the same request (for Idempotency-Key): a hash of the request as sent."""
    return hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_serving(state: ServerState) -> None:
    """A job is taken only where a synchronous request would be (images.py: submit_all): a 503 while the server
    drains or once its engine has stopped (the job would wait for a process that never runs it)."""
    if not state.engine.healthy:
        raise errors.engine_failed("the engine stopped after an internal error and serves no more requests")
    if state.draining or not state.engine.accepting:
        raise errors.shutting_down()


async def create_job(state: ServerState, job: JobRecord, print_: str, max_unfinished: int,
                     noun: str) -> tuple[JobRecord, bool]:
    """Store the job (see the module docstring): (job, True), or (the job made under its key, False). A webhook
    whose host is not somewhere webhooks go (jobs/targets.py; resolved off the loop) is a 400 first."""
    check_serving(state)
    if job.webhook and state.webhook_targets is not None:
        try:
            await asyncio.to_thread(state.webhook_targets.addresses, job.webhook["url"])
        except WebhookTargetError as exc:
            raise invalid(str(exc), "webhook", "webhook_not_allowed") from None
    job.meta["fingerprint"] = print_
    try:
        record, created = await state.jobs.create(job, max_unfinished)
    except TooManyUnfinished as exc:
        raise errors.queue_full(f"{exc.unfinished} {noun} are queued or running, the most this service holds; retry "
                                f"once one finishes", 5) from None
    except Exception as exc:  # noqa: BLE001 - the state store unreachable (a Redis restart, a locked file)
        log.warning("a job could not be stored in %s: %s", state.jobs.store.url, exc)
        raise APIError(503, f"the job was not made: the state store could not be written ({type(exc).__name__}); "
                            f"retry later", type="server_error", code="state_unavailable",
                       headers={"Retry-After": "1"}) from None
    if not created and record.meta.get("fingerprint") != print_:
        raise APIError(409, f"{IDEMPOTENCY_HEADER}: this key was used for {record.id}, made from another request; "
                            f"send a new key for a new request", param=IDEMPOTENCY_HEADER,
                       code="idempotency_key_reused")
    if created and record.webhook:  # its delivery, parked in the outbox until the job ends (jobs/webhooks.py)
        await asyncio.to_thread(park, state.jobs.store, record)
    return record, created


def job_error(exc: APIError) -> JobError:
    """An error answer as a failed job's error (and its outcome in the metrics)."""
    return JobError(exc.code or "failed", exc.message, outcome_of(exc))


MODEL_FAILURE = "the model failed on this request (the server's log has the details)"


def result_error(result: GenerationResult) -> JobError | None:
    """The failure a finished engine request stands for (the error a synchronous request would have answered); a
    model failure with a short message, its exception's text (paths, addresses) in the log only: a job's error is
    read by whoever holds its id, and sent to its webhook."""
    try:
        check(result)
    except APIError as exc:
        if exc.code == "model_failure":
            log.warning("a job's request %s failed in the model: %s", result.request_id, result.error)
            return JobError("model_failure", MODEL_FAILURE, outcome_of(exc))
        return job_error(exc)
    return None


def started_from(job: JobRecord) -> float:
    """The job's arrival as time.monotonic() (what ServerState's records measure from)."""
    return time.monotonic() - max(0.0, time.time() - job.created_at)


def check_streams(state: ServerState) -> None:
    """A 429 when this process serves as many job event streams as it may (jobs/changes.py: MAX_FOLLOWERS)."""
    changes = state.jobs.changes
    if not changes.reserve():
        raise APIError(429, f"{changes.max_followers} job event streams are open on this server, the most it "
                            f"serves at once; retry later, or poll the job (GET) instead", type="rate_limit_error",
                       code="too_many_streams", headers={"Retry-After": "5"})


async def job_events(state: ServerState, job: JobRecord, event: str,
                     describe: Callable[[JobRecord], Any]) -> AsyncIterator[bytes]:
    """`{event}.{status}` with the job as GET answers it, now and at each change, until it is finished. A job
    deleted meanwhile ends the stream with `{event}.failed`, its error `cancelled`. (The routes call
    check_streams first.)"""
    last = None
    async for record in state.jobs.follow(job):
        if record is None:
            if last is not None:
                last.update(status="failed", completed_at=int(time.time()),
                            error={"code": "cancelled", "message": "the job was deleted before it finished"})
                yield sse(f"{event}.failed", last)
            return
        last = await describe(record)
        yield sse(f"{event}.{record.status}", last)
