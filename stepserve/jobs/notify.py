"""A finished job's webhook: the one notification of a job that named a `webhook` URL, when it completes or fails
(never when it was deleted). The payload is {"type": "video.completed" | "video.failed" | "image.completed" |
"image.failed", "timestamp": ISO 8601 (UTC), "data": the job as GET answers it, without its results}; webhooks.py's
WebhookSender stores it in the outbox, signs it (Standard Webhooks), retries it and records the delivery's state on
the job.

Results are never inlined: an image job's `result` (base64 images, megabytes) is left out, and the receiver GETs
the job (or a video's content) by its id. So the body kept in the outbox, and sent on every attempt, stays small.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..store.base import JobRecord, iso_utc

log = logging.getLogger("stepserve.jobs")
INLINE = ("result",)  # what GET shows of a job that a webhook leaves out (the results themselves)


def payload(event: str, job: JobRecord, data: dict[str, Any]) -> dict[str, Any]:
    return {"type": f"{event}.{job.status}", "timestamp": iso_utc(job.completed_at or 0.0),
            "data": {k: v for k, v in data.items() if k not in INLINE}}


async def job_payload(kind: Any, job: JobRecord) -> dict[str, Any]:
    """The payload of a finished job of `kind` (a JobKind: its event name, and the job as GET answers it)."""
    return payload(kind.event, job, await kind.describe(job))


def payloads(kinds: Mapping[str, Any]) -> Callable[[JobRecord], Awaitable[dict[str, Any]]]:
    """What the sender builds the payload of a parked delivery with (its process died before storing the body):
    the same as notify's, for a job of these kinds; the job's id, status and error for another."""
    async def of(job: JobRecord) -> dict[str, Any]:
        kind = kinds.get(job.kind)
        if kind is None:
            return payload(job.kind, job, {"id": job.id, "status": job.status, "error": job.error})
        return await job_payload(kind, job)

    return of


async def notify(sender: Any, kind: Any, job: JobRecord, owner: str) -> None:
    """Deliver the job's one notification (a task of the runner's: it ends when delivered or given up)."""
    try:
        await sender.deliver(job, await job_payload(kind, job), owner)
    except Exception:  # noqa: BLE001 - a notification never fails the job
        log.exception("job %s: its webhook could not be sent", job.id)
