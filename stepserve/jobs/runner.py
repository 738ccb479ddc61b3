"""JobRunner: runs jobs from the store on this process's engine. Jobs are pulled: while this process runs fewer
than `max_running` jobs and its engine is healthy, it claims the oldest claimable job of its service and of the
kinds it makes (store.claim_job filters them in its query: a job it cannot run is never taken), submits its engine
requests, and follows them.

- Progress: after every denoising step the job's record is written (`update_job` fenced by this process's
  `owner`: status, progress, and the lease renewed). A write that returns None means the job was deleted (through
  any process) or taken over by another: the engine requests are aborted at once and nothing more is written. So
  a DELETE anywhere stops the job within two of its steps.
- Leases: `lease_s` (30 s by default), renewed at every step and at least every lease_s / 3 while the job waits in
  the engine's queue or its files are being made. A process that dies stops renewing; once the lease has passed
  another process (or this one, restarted) claims the job and runs it again from the start; the job's stored
  request (its seed included) makes the same result.
- Adoption: at start, the jobs of before services (service "") that this model made become this service's.
- Orphans: at start, jobs that this owner holds in the store (left by a previous life of this process, killed
  before it could hand them back) are handed back at once, without waiting for their leases.
- Waking: a POST wakes the runner (`wake()`); otherwise it polls the store every `poll_s` (1 s).
- A hand-back (a full engine queue, 429 at admission; an engine that stopped) is followed by `backoff_s` without
  a claim; an engine that is not healthy claims nothing at all (its process must be restarted: others run the jobs).
- Attempts: a job claimed `max_attempts` times without finishing (its process died on it each time: a host out of
  memory, a native crash) ends failed (`too_many_attempts`) in the claim itself, and the next job is taken. A clean
  hand-back (a drain, a full engine) gives its claim back: only the claims a process died on (or its engine) count.
- Endings: a finished job's files go to the results folder, then the record says completed (or failed, with the
  error); the kind is told the job's end once (metrics, access log), and a job with a webhook gets its one
  notification (webhook.py's sender, run as a task).
- Drain: stop_claiming(), then close(): the jobs still running get `wait_s`, then each unfinished one is handed
  back to the store (a durable store: another process, or this one restarted, runs it) or, with the memory store,
  ends failed (`shutting_down`), as before the store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from ..engine.async_engine import AsyncEngine
from ..store.base import JobRecord, Store
from ..store.results import Results
from .attempt import Attempts, Running
from .changes import Changes
from .kinds import JobKind

log = logging.getLogger("stepserve.jobs")
ORPHAN_SCAN = 1000  # the newest jobs looked at for orphans of this owner at start


class JobRunner(Attempts):
    def __init__(self, engine: AsyncEngine, store: Store, results: Results, owner: str,
                 kinds: Mapping[str, JobKind], *, service: str, max_running: int, lease_s: float = 30.0,
                 poll_s: float = 1.0, backoff_s: float = 1.0, max_attempts: int | None = None,
                 changes: Changes | None = None, sender: Any = None) -> None:
        if max_running < 1 or lease_s <= 0 or poll_s <= 0 or (max_attempts is not None and max_attempts < 1):
            raise ValueError("max_running and max_attempts must be >= 1, lease_s and poll_s > 0")
        self.engine, self.store, self.results, self.owner = engine, store, results, owner
        self.kinds, self.service, self.max_attempts = dict(kinds), service, max_attempts
        self.max_running, self.lease_s, self.poll_s, self.backoff_s = max_running, lease_s, poll_s, backoff_s
        self.changes = changes or Changes()
        self.sender = sender  # the webhook sender (jobs/notify.py); None: no notifications
        self.durable = store.url != "memory"  # another process (or a restart) can take over what is handed back
        self.claiming = True
        self.running: dict[str, Running] = {}
        self._wake = asyncio.Event()
        self._backoff_until = 0.0
        self._closing = False
        self._loop_task: asyncio.Task | None = None
        self._deliveries: set[asyncio.Task] = set()
        self._failing = False  # the store failed on the last round (logged once until it answers again)
        self.rounds = 0  # rounds of the claiming loop done (tests wait on it)

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.ensure_future(self._loop())

    def wake(self) -> None:
        self._wake.set()

    def stop_claiming(self) -> None:
        self.claiming = False

    async def close(self, wait_s: float = 5.0) -> None:
        """Stop: the jobs running get `wait_s` to end (the engine has shut down by now, or is about to), then what
        is unfinished is handed back (durable store) or fails as shutting_down (memory)."""
        self.claiming, self._closing = False, True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        tasks = [r.task for r in self.running.values() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=wait_s)
        for run in list(self.running.values()):
            if run.task is not None and not run.task.done():
                run.task.cancel()
                await asyncio.gather(run.task, return_exceptions=True)
            if not run.ended:
                await self._cut_short(run)
        if self._deliveries:
            await asyncio.wait(self._deliveries, timeout=wait_s)
        for task in self._deliveries:
            task.cancel()
        close = getattr(self.sender, "close", None)
        if close is not None:
            await close()

    def cancel(self, job_id: str) -> bool:
        """The job was deleted through this process: when it runs here, stop it at once and tell its end (as
        cancelled) now. Whether it ran here."""
        run = self.running.get(job_id)
        if run is None:
            return False
        run.gone = True
        self._abort(run)
        if not run.ended:
            run.ended = True
            self._tell_end(self.kinds[run.job.kind], run.job, "cancelled", ())
        return True

    # -- claiming -----------------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        await self._guarded(self._adopt)
        await self._guarded(self._hand_back_orphans)
        next_resume, resuming = 0.0, None
        while not self._closing:  # (a cancellation that asyncio.wait_for swallowed in 3.11 still ends the loop)
            self._wake.clear()
            await self._guarded(self._claim_while_room)
            await self._guarded(self._renew_due)
            if self.sender is not None and time.monotonic() >= next_resume:  # deliveries a dead process left
                next_resume = time.monotonic() + self.lease_s
                resume = getattr(self.sender, "resume", None)
                if resume is not None and (resuming is None or resuming.done()):
                    resuming = asyncio.ensure_future(resume(self.owner))
                    self._spawn_task(resuming)
            self.rounds += 1
            try:
                await asyncio.wait_for(self._wake.wait(), min(self.poll_s, self.lease_s / 3))
            except asyncio.TimeoutError:
                pass

    async def _adopt(self) -> None:
        """The jobs this model made before services (a state of 0.4) become this service's."""
        adopted = await asyncio.to_thread(self.store.adopt_jobs, self.engine.model_info.name, self.service)
        if adopted:
            log.info("jobs: %d job(s) of %s made before services are now service %s's", adopted,
                     self.engine.model_info.name, self.service)

    async def _hand_back_orphans(self) -> None:
        jobs = await asyncio.to_thread(self.store.list_jobs, None, ORPHAN_SCAN, self.service)
        orphans = [j for j in jobs if j.owner == self.owner and not j.finished and j.id not in self.running]
        for job in orphans:
            await asyncio.to_thread(self.store.release_job, job.id, self.owner, True)  # its process died on it
        if orphans:
            log.info("jobs: %d job(s) of %s's previous run handed back to run again", len(orphans), self.owner)

    async def _claim_while_room(self) -> None:
        kinds = tuple(self.kinds)
        while self.claiming and len(self.running) < self.max_running and time.monotonic() >= self._backoff_until \
                and self.engine.healthy:
            ended: list[JobRecord] = []
            job = await asyncio.to_thread(self.store.claim_job, self.owner, self.lease_s, kinds, None, self.service,
                                          self.max_attempts, ended)
            for record in ended:  # failed in the claim (too many attempts): their ends are told here
                self._gave_up(record)
            if job is None:
                return
            if job.id in self.running:  # ours still, though its lease lapsed (a stalled loop): it runs on here
                self.running[job.id].job = job
                continue
            run = Running(job)
            self.running[job.id] = run
            if not self.claiming:  # draining began meanwhile
                await self._hand_back(run)
                return
            run.task = asyncio.ensure_future(self._run(run))

    def _gave_up(self, record: JobRecord) -> None:
        """A job the claim ended failed: its end told once (metrics, the access log), and its webhook sent."""
        log.warning("job %s: %s", record.id, (record.error or {}).get("message"))
        kind = self.kinds[record.kind]
        self.changes.publish(record.id, record)
        self._tell_end(kind, record, "failed", ())
        if record.webhook and self.sender is not None:
            self._spawn(self._notify(kind, record))

    async def _renew_due(self) -> None:
        due = time.monotonic() - self.lease_s / 3
        for run in list(self.running.values()):
            if run.last_write <= due and not run.gone and not run.ended and not run.writing.locked():
                await self._write(run)

    # -- one job ------------------------------------------------------------------------------------------------
