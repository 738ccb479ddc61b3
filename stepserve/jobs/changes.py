"""Following one job as it changes (the `/events` routes): from this process's own changes when the job runs here,
else from the store, read every POLL_S seconds by one poll per job, whatever the number of its followers.

Changes is the process's local bus: the runner publishes a job's record after each of its writes, and DELETE
publishes None. While a job has followers, one task reads it from the store whenever nothing was published for it
for POLL_S, and publishes what it read: so N streams of one job cost one store read per POLL_S, not N. follow()
yields the job's record each time it differs (status, progress, error, results), and ends after a finished one, or
with None once the job is gone (deleted, or swept). A process serves at most `max_followers` streams at once (each
holds a connection; the routes reserve one before answering, and answer 429 past it: `reserve`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from ..store.base import JobRecord, Store

log = logging.getLogger("stepserve.jobs")
POLL_S = 0.5  # how often a followed job is read from the store when no change reached it from this process
MAX_FOLLOWERS = 64  # event streams of jobs one process serves at once
RESERVE_S = 10.0  # a stream let in whose body never started (its client left first) stops counting then


class Changes:
    def __init__(self, store: Store | None = None, poll_s: float = POLL_S, max_followers: int = MAX_FOLLOWERS) -> None:
        self.store, self.poll_s, self.max_followers = store, poll_s, max_followers
        self.following = 0  # streams open now
        self._reserved: list[float] = []  # streams let in whose body has not started yet (when: monotonic)
        self._queues: dict[str, set[asyncio.Queue]] = {}
        self._polls: dict[str, asyncio.Task] = {}  # one per followed job (with a store)
        self._heard: dict[str, float] = {}  # followed job -> when its last record was published (monotonic)

    @property
    def full(self) -> bool:
        return self.following + len(self._reserved) >= self.max_followers

    def reserve(self) -> bool:
        """Let one more stream in, counted at once: a route's check and its stream's start are apart (the body
        starts after the answer's head), so a burst of requests would all pass a check that counted started
        streams only. False when full. A reservation whose stream never starts lapses after RESERVE_S."""
        now = time.monotonic()
        self._reserved = [t for t in self._reserved if now - t < RESERVE_S]
        if self.full:
            return False
        self._reserved.append(now)
        return True

    def subscribe(self, job_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.setdefault(job_id, set()).add(queue)
        if self.store is not None and job_id not in self._polls:
            self._heard[job_id] = time.monotonic()
            self._polls[job_id] = asyncio.ensure_future(self._poll(job_id))
        return queue

    def unsubscribe(self, job_id: str, queue: asyncio.Queue) -> None:
        queues = self._queues.get(job_id)
        if queues is not None:
            queues.discard(queue)
            if not queues:
                del self._queues[job_id]
                self._heard.pop(job_id, None)
                poll = self._polls.pop(job_id, None)
                if poll is not None:
                    poll.cancel()

    def publish(self, job_id: str, record: JobRecord | None) -> None:
        if job_id in self._heard:
            self._heard[job_id] = time.monotonic()
        for queue in self._queues.get(job_id, ()):
            queue.put_nowait(record)

    async def _poll(self, job_id: str) -> None:
        """The one store read of a followed job, each time POLL_S passed without a change published for it."""
        while True:
            await asyncio.sleep(max(0.0, self._heard.get(job_id, 0.0) + self.poll_s - time.monotonic()))
            if time.monotonic() - self._heard.get(job_id, 0.0) < self.poll_s:
                continue
            try:
                record = await asyncio.to_thread(self.store.get_job, job_id)  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - a store that fails for a moment: the next poll asks again
                log.debug("following job %s: %s", job_id, exc)
                self._heard[job_id] = time.monotonic()
                continue
            self.publish(job_id, record)


def _seen(job: JobRecord) -> tuple:
    return job.status, job.progress, job.error, tuple(job.results), job.completed_at


async def follow(changes: Changes, job_id: str, first: JobRecord | None = None) -> AsyncIterator[JobRecord | None]:
    """The job now (`first` when the caller has just read it), then each change; see the module docstring."""
    if changes._reserved:  # the stream its route let in has started
        changes._reserved.pop(0)
    changes.following += 1
    queue = changes.subscribe(job_id)
    try:
        job = first if first is not None else await asyncio.to_thread(changes.store.get_job, job_id)  # type: ignore
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
            job = await queue.get()
            while not queue.empty():  # only the newest of the changes that piled up
                job = queue.get_nowait()
    finally:
        changes.following -= 1
        changes.unsubscribe(job_id, queue)
