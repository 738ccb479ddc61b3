"""One job's run on this process (JobRunner's half that follows a claimed job to its end: runner.py says how jobs
are claimed, leased and handed back): submit its engine requests, write its progress at every step (the write that
returns None stops it), make its files, write its end, tell it once, and send its webhook.

Result files are named per attempt (the kinds name them with job.attempts, unique per claim), and published by the
fenced final write (its `results`). An attempt that lost its job (a stall past its lease, a partition: another
process ran it meanwhile) deletes only the files it wrote itself, which no one published: never the new owner's.
A store error at the end is retried while the lease holds; a finished job is never marked failed for it.
A job that fails on an unexpected error says `internal_error` and a short message; the exception goes to the log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..addons.errors import AddonBudgetError, AddonError, AddonTooLargeError
from ..engine.admission_errors import DeadlineInfeasibleError, DeadlineRefusedError, QueueFullError
from ..engine.async_engine import AsyncEngine
from ..engine.handles import EngineDeadError, RequestHandle, ShuttingDownError
from ..request.types import FinishReason, GenerationResult
from ..request.validation import ValidationError
from ..store.base import COMPLETED, FAILED, IN_PROGRESS, JobRecord, Store
from ..store.results import Results
from .changes import Changes
from .following import follow_requests
from .kinds import JobError, JobKind
from .notify import notify

log = logging.getLogger("stepserve.jobs")
INTERNAL = "the job failed on an internal error of the server (its log has the details); sending it again may work"


class EndNotWritten(Exception):
    """The store refused the job's end until its lease was about to pass: another process will run it again."""


@dataclass(eq=False)
class Running:
    job: JobRecord
    task: asyncio.Task | None = None
    handles: list[RequestHandle] = field(default_factory=list)
    last_write: float = field(default_factory=time.monotonic)
    writing: asyncio.Lock = field(default_factory=asyncio.Lock)
    gone: bool = False  # deleted or taken over: stop, write nothing more
    stepped: bool = False  # its first step was written (with its engine request ids, in meta)
    ended: bool = False  # its end was dealt with (written, handed back, or gone)


class Attempts:
    """The per-job half of JobRunner (its attributes are set by JobRunner.__init__)."""

    engine: AsyncEngine
    store: Store
    results: Results
    owner: str
    kinds: dict[str, JobKind]
    lease_s: float
    poll_s: float
    backoff_s: float
    changes: Changes
    sender: Any
    durable: bool
    running: dict[str, Running]
    _backoff_until: float
    _deliveries: set[asyncio.Task]
    _failing: bool

    def wake(self) -> None:
        raise NotImplementedError

    async def _guarded(self, step) -> None:
        try:
            await step()
            if self._failing:
                log.warning("the state store %s answers again", self.store.url)
            self._failing = False
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a store that fails for a while (a restart of Redis) is retried
            if not self._failing:
                log.exception("jobs: the state store %s failed; retrying every %g s", self.store.url, self.poll_s)
            self._failing = True

    async def _write(self, run: Running, **changes: Any) -> JobRecord | None:
        """Write the job's changes and renew its lease, as its owner. None when it is no longer ours (it is then
        stopped here)."""
        if run.gone:
            return None
        job_id, owner, store, lease_s = run.job.id, self.owner, self.store, self.lease_s

        def update() -> JobRecord | None:
            if "completed_at" in changes:
                changes["completed_at"] = store.now()
            return store.update_job(job_id, owner=owner, lease_until=store.now() + lease_s, **changes)

        async with run.writing:
            record = await asyncio.to_thread(update)
            run.last_write = time.monotonic()
        if record is None:
            run.gone = True
            self._abort(run)
            return None
        run.job = record
        self.changes.publish(job_id, record)
        return record

    def _abort(self, run: Running) -> None:
        for handle in run.handles:
            self.engine.abort(handle.request_id)

    async def _run(self, run: Running) -> None:
        kind = self.kinds[run.job.kind]
        try:
            error = await self._steps(run, kind)
            if error is not None:
                await self._guarded(lambda: self._end(run, kind, FAILED, (), error=error))
        except asyncio.CancelledError:
            self._abort(run)
            raise
        finally:
            self.running.pop(run.job.id, None)
            self.wake()  # room for the next job

    async def _steps(self, run: Running, kind: JobKind) -> JobError | None:
        """Run the job to its end; the error it failed with when that is still to be written."""
        try:
            inputs = (run.job.request.get("inputs") or {}).values()
            await asyncio.to_thread(self.results.touch, inputs)  # they outlive this run (the sweep goes by age)
            params = await kind.params(run.job)
            if await self._submit(run, params):
                results = await follow_requests(run.handles, lambda p: self._progress(run, p),
                                                lambda: self._abort(run))
                if results is not None:
                    await self._finish(run, kind, results)
            if run.gone and not run.ended:
                await self._lost(run, kind)
            return None
        except JobError as exc:
            self._abort(run)
            return exc
        except EndNotWritten:
            log.warning("job %s: its end could not be written to the state store within its lease; left to run "
                        "again", run.job.id)
            run.ended = True
            self._abort(run)
            return None
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a job fails alone; the runner runs on
            log.exception("job %s failed", run.job.id)  # the details (paths, addresses) for the operator only
            self._abort(run)
            return JobError("internal_error", INTERNAL)

    async def _submit(self, run: Running, params: list) -> bool:
        try:
            await self.engine.resolve_adapters(params)  # adapters registered through another process
            run.handles = await self.engine.submit_many_off_loop(params, stream=True)
        except DeadlineInfeasibleError as exc:
            raise JobError("deadline_infeasible", f"timeout_s: {exc}", "invalid") from None
        except (QueueFullError, DeadlineRefusedError, AddonBudgetError):  # full now: another time, or process
            await self._hand_back(run)
            return False
        except AddonError as exc:  # an adapter that can never be served here
            raise JobError("addon_too_large" if isinstance(exc, AddonTooLargeError) else "invalid_value", str(exc),
                           "invalid") from None
        except ValidationError as exc:  # an adapter deleted since the job was made, say
            raise JobError("invalid_value", str(exc), "invalid") from None
        except (ShuttingDownError, EngineDeadError) as exc:  # an engine that died on it counts as an attempt
            await self._cut_short(run, counted=isinstance(exc, EngineDeadError))
            return False
        if run.gone:  # deleted while it was being admitted
            self._abort(run)
            return False
        return True

    async def _progress(self, run: Running, progress: int) -> bool:
        """Write the progress (and renew the lease); False when the job is no longer ours. A store that fails
        here does not stop the job: the next write, or the renewal, tries again."""
        try:
            record = await self._write(run, status=IN_PROGRESS, progress=progress, **self._first(run))
            run.stepped = run.stepped or record is not None
            return record is not None
        except Exception:  # noqa: BLE001
            log.warning("job %s: its progress could not be written to the state store", run.job.id, exc_info=True)
            return True

    @staticmethod
    def _first(run: Running) -> dict[str, Any]:
        """The job's engine request ids, written with its first write after they are known."""
        if run.stepped or not run.handles:
            return {}
        return {"meta": {**run.job.meta, "request_ids": [h.request_id for h in run.handles]}}

    async def _finish(self, run: Running, kind: JobKind, results: list[GenerationResult]) -> None:
        aborted = [r for r in results if r.finish_reason is FinishReason.ABORTED]
        if run.gone:
            return
        if aborted:  # not by us: the engine shut down under it
            await self._cut_short(run)
            return
        errors = [e for e in map(kind.error_of, results) if e is not None]
        error = next((e for r, e in zip(results, map(kind.error_of, results))
                      if e is not None and not isinstance(getattr(r, "cause", None), AddonBudgetError)), None)
        if error is None and errors:  # only an add-on memory held by requests in flight now: another time,
            await self._hand_back(run, counted=True)  # counted, so --job-max-attempts bounds the retries
            return
        if error is not None:
            await self._end(run, kind, FAILED, results, error=error)
            return
        files = await kind.finish(run.job, results)  # named for this attempt: no other process writes them
        names: list[str] = []
        published = False
        try:
            for name, data in files.items():
                names.append(await asyncio.to_thread(self.results.write, name, data))
            published = await self._end(run, kind, COMPLETED, results, names=names)
        finally:  # lost (deleted, or run by another meanwhile), or not written: only ours go, and only when the
            # store says they are not what the job points to (an end written whose answer was lost keeps them)
            if not published and not await self._published_anyway(run.job.id, names):
                await asyncio.to_thread(self.results.delete, names)

    async def _published_anyway(self, job_id: str, names: list[str]) -> bool:
        """Whether the stored job points to these files after all (the end was written, its answer lost). When the
        store cannot tell, True: a file kept is swept by age, a file deleted under a completed job is lost."""
        if not names:
            return False
        try:
            record = await asyncio.to_thread(self.store.get_job, job_id)
        except Exception:  # noqa: BLE001
            return True
        return record is not None and set(names) <= set(record.results)

    async def _end(self, run: Running, kind: JobKind, status: str, results: Sequence[GenerationResult],
                   error: JobError | None = None, names: list[str] | None = None) -> bool:
        changes: dict[str, Any] = {"status": status, "completed_at": None, **self._first(run)}
        if status == COMPLETED:
            changes.update(progress=100, results=names or [])
        else:
            changes["error"] = error.as_error() if error is not None else None
        record = await self._final_write(run, changes)
        if record is None:
            await self._lost(run, kind)
            return False
        run.ended = True
        outcome = "completed" if status == COMPLETED else (error.outcome if error is not None else "failed")
        self._tell_end(kind, record, outcome, results)
        if record.webhook and self.sender is not None:
            self._spawn(self._notify(kind, record))
        return True

    async def _final_write(self, run: Running, changes: dict[str, Any]) -> JobRecord | None:
        """The job's end, written as its owner; a store that fails is asked again every poll_s while the lease
        (renewed at the last write that went through) still holds. EndNotWritten once it would not."""
        while True:
            try:
                return await self._write(run, **changes)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a store that fails for a moment (a Redis failover, a locked file)
                if time.monotonic() + self.poll_s >= run.last_write + self.lease_s:
                    raise EndNotWritten() from None
                log.warning("job %s: its end could not be written to the state store; retrying", run.job.id,
                            exc_info=True)
                await asyncio.sleep(self.poll_s)

    async def _notify(self, kind: JobKind, record: JobRecord) -> None:
        await notify(self.sender, kind, record, self.owner)

    async def _lost(self, run: Running, kind: JobKind) -> None:
        """The job is no longer ours: deleted (its end is told here, as cancelled) or taken over (the new owner
        tells it)."""
        run.ended = True
        self._abort(run)
        record = await asyncio.to_thread(self.store.get_job, run.job.id)
        if record is None:
            self._tell_end(kind, run.job, "cancelled", ())
        else:
            log.warning("job %s: taken over by %s (this process, %s, let its lease pass); stopped here", run.job.id,
                        record.owner, self.owner)

    async def _hand_back(self, run: Running, counted: bool = False) -> None:
        """Give the job back to the store unfinished (its claim counted as an attempt only when `counted`); nothing
        is claimed for backoff_s (no claim-and-hand-back loop)."""
        run.ended = True
        self._backoff_until = time.monotonic() + self.backoff_s
        record = await asyncio.to_thread(self.store.release_job, run.job.id, self.owner, counted)
        self.running.pop(run.job.id, None)
        if record is not None:
            self.changes.publish(record.id, record)

    async def _cut_short(self, run: Running, counted: bool = False) -> None:
        """The process stops before the job finished: hand it back, or (memory store) it fails."""
        self._abort(run)
        if self.durable:
            await self._guarded(lambda: self._hand_back(run, counted))
            return
        kind = self.kinds[run.job.kind]
        error = JobError("shutting_down", "the server shut down before the job finished", "shutting_down")
        await self._guarded(lambda: self._end(run, kind, FAILED, (), error=error))
        run.ended = True

    def _tell_end(self, kind: JobKind, record: JobRecord, outcome: str, results: Sequence[GenerationResult]) -> None:
        try:
            kind.ended(record, outcome, results)
        except Exception:  # noqa: BLE001 - bookkeeping never fails a job
            log.exception("recording the end of job %s failed", record.id)

    def _spawn(self, coroutine) -> None:
        self._spawn_task(asyncio.ensure_future(coroutine))

    def _spawn_task(self, task: asyncio.Task) -> None:
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

