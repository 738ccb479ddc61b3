"""Following one job as it changes (the `/events` routes): from this process's own changes when the job runs here,
else by reading the store every POLL_S seconds.

Changes is the process's local bus: the runner publishes a job's record after each of its writes, and DELETE
publishes None. follow() yields the job's record each time it differs (status, progress, error, results), and ends
after a finished one, or with None once the job is gone (deleted, or swept).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ..store.base import JobRecord, Store

POLL_S = 0.5  # how often a follower reads the store when no change reached it from this process


class Changes:
    def __init__(self) -> None:
        self._queues: dict[str, set[asyncio.Queue]] = {}

    def subscribe(self, job_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.setdefault(job_id, set()).add(queue)
        return queue

    def unsubscribe(self, job_id: str, queue: asyncio.Queue) -> None:
        queues = self._queues.get(job_id)
        if queues is not None:
            queues.discard(queue)
            if not queues:
                del self._queues[job_id]

    def publish(self, job_id: str, record: JobRecord | None) -> None:
        for queue in self._queues.get(job_id, ()):
            queue.put_nowait(record)


def _seen(job: JobRecord) -> tuple:
    return job.status, job.progress, job.error, tuple(job.results), job.completed_at


async def follow(store: Store, changes: Changes, job_id: str, first: JobRecord | None = None,
                 poll_s: float = POLL_S) -> AsyncIterator[JobRecord | None]:
    """The job now (`first` when the caller has just read it), then each change; see the module docstring."""
    queue = changes.subscribe(job_id)
    try:
        job = first if first is not None else await asyncio.to_thread(store.get_job, job_id)
        last = None
        while True:
            if job is None:
                yield None
                return
            if _seen(job) != last:
                last = _seen(job)
                yield job
                if job.finished:
                    return
            try:
                job = await asyncio.wait_for(queue.get(), poll_s)
                while not queue.empty():  # only the newest of the changes that piled up
                    job = queue.get_nowait()
            except asyncio.TimeoutError:
                job = await asyncio.to_thread(store.get_job, job_id)
    finally:
        changes.unsubscribe(job_id, queue)
