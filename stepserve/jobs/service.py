"""Jobs: what a server holds of the jobs subsystem (one per app): the store, the results folder, the runner, the
local change bus and the sweep, with the few operations the HTTP routes need. Every store call runs off the event
loop (asyncio.to_thread). Synchronous image requests never come here.

Jobs belong to a service (`service`: by default derived from what the server serves, server/jobs_app.py; `serve
--service NAME` shares one deliberately, as replicas of one deployment do). A server creates its jobs in its
service, and lists, reads, counts, claims and deletes only that service's: another's job is not found here (404).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Mapping

from ..engine.async_engine import AsyncEngine
from ..store.base import DEFAULT_MAX_ATTEMPTS, JobRecord, Store, TooManyUnfinished  # noqa: F401 (create's refusal)
from ..store.results import Results
from .changes import Changes, follow
from .kinds import JobKind, job_files
from .runner import JobRunner
from .sweep import SWEEP_EVERY_S, sweep_forever

def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class Jobs:
    def __init__(self, engine: AsyncEngine, store: Store, results: Results, owner: str,
                 kinds: Mapping[str, JobKind], *, service: str, max_running: int, lease_s: float = 30.0,
                 poll_s: float = 1.0, max_attempts: int = DEFAULT_MAX_ATTEMPTS, sender=None,
                 webhook_secret: str | None = None, sweep_every_s: float = SWEEP_EVERY_S,
                 on_close: Callable[[], None] | None = None) -> None:
        self.store, self.results, self.kinds, self.service = store, results, dict(kinds), service
        self.changes = Changes(store)
        self.runner = JobRunner(engine, store, results, owner, kinds, service=service, max_running=max_running,
                                lease_s=lease_s, poll_s=poll_s, max_attempts=max_attempts, changes=self.changes,
                                sender=sender)
        self.sweep_every_s = sweep_every_s
        self.webhook_secret = webhook_secret  # what webhooks are signed with (a job naming one needs it)
        self.on_close = on_close  # closes what the app opened for itself (a memory store, a temporary folder)
        self._sweeper: asyncio.Task | None = None

    @property
    def owner(self) -> str:
        return self.runner.owner

    @property
    def busy(self) -> bool:
        """Jobs are running here (a drain waits for them)."""
        return bool(self.runner.running)

    def start(self) -> None:
        self.runner.start()
        self._sweeper = asyncio.ensure_future(sweep_forever(self.store, self.results, self.sweep_every_s))

    def stop_claiming(self) -> None:
        self.runner.stop_claiming()

    async def close(self, wait_s: float = 5.0) -> None:
        await self.runner.close(wait_s)
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        if self.on_close is not None:
            self.on_close()

    async def create(self, job: JobRecord, max_unfinished: int) -> tuple[JobRecord, bool]:
        """Store a new job of this service (created_at: the store's clock) and wake the runner: (job, True); or the
        job made earlier under the same idempotency key: (it, False). TooManyUnfinished when `max_unfinished` jobs
        of its kind and service are queued or running (the store counts them in the insert itself). The key is
        the service's own: another service's job under the same key is neither returned nor in the way."""
        store = self.store
        job.service = self.service
        if job.idempotency_key is not None:
            job.idempotency_key = f"{self.service}/{job.idempotency_key}"

        def create() -> tuple[JobRecord, bool]:
            job.created_at = store.now()
            return store.create_job(job, max_unfinished)

        record, created = await asyncio.to_thread(create)
        if created:
            self.runner.wake()
        return record, created

    def ours(self, job: JobRecord | None, kind: str) -> bool:
        """A job of this kind and of this service (any other is not found here)."""
        return job is not None and job.kind == kind and job.service == self.service

    async def get(self, kind: str, job_id: str) -> JobRecord | None:
        job = await asyncio.to_thread(self.store.get_job, job_id)
        return job if self.ours(job, kind) else None

    async def list(self, kind: str, limit: int = 100) -> list[JobRecord]:
        return await asyncio.to_thread(self.store.list_jobs, kind, limit, self.service)

    async def delete(self, kind: str, job_id: str) -> JobRecord | None:
        """Forget the job and its files; stop it where it runs (here at once; elsewhere at its next write). Its end
        is told here when nobody ran it (queued, or its owner's lease has passed)."""
        store = self.store

        def delete() -> tuple[JobRecord | None, float]:
            if not self.ours(store.get_job(job_id), kind):
                return None, 0.0
            return store.delete_job(job_id), store.now()

        job, now = await asyncio.to_thread(delete)
        if job is None:
            return None
        ran_here = self.runner.cancel(job_id)
        self.changes.publish(job_id, None)
        await asyncio.to_thread(self.results.delete, job_files(job))
        if not job.finished and not ran_here and (job.owner is None or job.lease_until < now):
            self.kinds[kind].ended(job, "cancelled", ())
        return job

    def follow(self, job: JobRecord) -> AsyncIterator[JobRecord | None]:
        """The job as it changes (changes.follow), from `job` as just read."""
        return follow(self.changes, job.id, first=job)
