"""A finished job's webhook: the one notification of a job that named a `webhook` URL, when it completes or fails
(never when it was deleted). The payload is {"type": "video.completed" | "video.failed" | "image.completed" |
"image.failed", "timestamp": ISO 8601 (UTC), "data": the job as GET answers it}; webhooks.py's WebhookSender signs
it (Standard Webhooks), retries it and records the delivery's state on the job.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

from ..store.base import JobRecord

log = logging.getLogger("stepserve.jobs")


def payload(event: str, job: JobRecord, data: dict[str, Any]) -> dict[str, Any]:
    stamp = datetime.fromtimestamp(job.completed_at or 0.0, timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": f"{event}.{job.status}", "timestamp": stamp, "data": data}


async def notify(sender: Any, kind: Any, job: JobRecord, owner: str) -> None:
    """Deliver the job's one notification (a task of the runner's: it ends when delivered or given up)."""
    try:
        await sender.deliver(job, payload(kind.event, job, await kind.describe(job)), owner)
    except Exception:  # noqa: BLE001 - a notification never fails the job
        log.exception("job %s: its webhook could not be sent", job.id)
