"""The state that outlives a request, behind one small interface: jobs (video jobs and async image jobs), adapter
registrations, idempotency keys, and what each replica says it holds. No torch, no engine.

Every replica (and a restarted process) reads the same store, so any of them can answer for any job. A replica
keeps only caches of what the store says. Backends, chosen by URL (store/__init__.py: open_store):
- memory: this process only (the behaviour before the store: nothing survives a restart);
- sqlite:///PATH: one file, shared by processes on one machine (WAL mode);
- redis://HOST:PORT/DB: replicas on several machines.

Leases. A job being run has an `owner` (a process's id) and `lease_until` (the store's clock, seconds since the
epoch). The owner renews the lease while it runs (`update_job` with `owner=` fences every write: a process that
lost its job, to a takeover or a DELETE, gets None and stops). A job whose lease has passed is claimable again by
any process: it reruns from the start, and its seed makes the result the same.

Records are plain data (JSON-able dicts inside) so that every backend stores them as one JSON document.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Protocol

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
FINISHED = (COMPLETED, FAILED)
KINDS = ("video", "image")


@dataclass
class JobRecord:
    id: str
    kind: str  # "video" or "image"
    request: dict[str, Any]  # everything needed to run it again from the start (JSON-able), as the server wrote it
    created_at: float  # the store's clock when it was created
    status: str = QUEUED  # queued -> in_progress -> completed | failed (a rerun after a takeover starts at queued)
    progress: int = 0  # 0-100
    completed_at: float | None = None
    error: dict[str, Any] | None = None  # {"code", "message"} when failed
    owner: str | None = None  # the process running it; None while nobody does
    lease_until: float = 0.0  # the owner's claim ends then unless renewed (store clock)
    attempts: int = 0  # how many times it was claimed
    results: list[str] = field(default_factory=list)  # file names in the results folder, once completed
    webhook: dict[str, Any] | None = None  # {"url", "state": pending|delivered|failed, "attempts", "last_status",
    # "last_error", "delivered_at"}: the delivery's outcome (its body and sender: the outbox, DeliveryRecord)
    idempotency_key: str | None = None  # the client's Idempotency-Key (scoped by the server: see create_job)
    meta: dict[str, Any] = field(default_factory=dict)  # the server's own details (model, request id, ...)
    service: str = ""  # the service it belongs to: only that service's servers list, read, claim or delete it

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


JOB_FIELDS = frozenset(f.name for f in fields(JobRecord))
FIXED_FIELDS = ("id", "idempotency_key", "service")  # set at creation, never changed
DEFAULT_MAX_ATTEMPTS = 3  # serve --job-max-attempts: claims of a job that never finished before it fails
TOO_MANY_ATTEMPTS = "too_many_attempts"  # the error code of a job claimed max_attempts times without finishing


def iso_utc(seconds: float) -> str:
    """A store-clock time as clients read it: ISO 8601 in UTC with a Z (jobs' and webhooks' timestamps)."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def attempts_error(attempts: int) -> dict[str, str]:
    """The error of a job that was claimed `attempts` times and never finished (its process died on it each
    time: a host out of memory, a native crash): it fails instead of crash-looping every process that starts."""
    return {"code": TOO_MANY_ATTEMPTS, "message": f"the job was started {attempts} times and its process stopped "
                                                  f"before it finished each time; it is not run again"}


SERVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # no "/" or ":": part of keys (redis.py)


def check_service(name: str) -> str:
    """A service name as given (serve --service); ValueError saying what is allowed otherwise."""
    if not SERVICE_NAME.fullmatch(name):
        raise ValueError(f"service {name[:120]!r}: allowed: 1 to 100 letters, digits, '.', '_' or '-', starting with "
                         f"a letter or digit")
    return name


RELEASED = {"owner": None, "lease_until": 0.0, "status": QUEUED, "progress": 0}  # a job handed back (release_job)


def release(job: JobRecord, counted: bool) -> None:
    """A hand-back, in place (the Python backends; redis_scripts.py's `release` is the same in Lua): the job is
    nobody's and queued; its claim counts as an attempt only when `counted`."""
    for name, value in RELEASED.items():
        setattr(job, name, value)
    if not counted:
        job.attempts = max(0, job.attempts - 1)


def take(job: JobRecord, owner: str, now: float, lease_s: float, max_attempts: int | None) -> bool:
    """A claim of a claimable job, in place (the Python backends; redis_scripts.py's `claim` is the same in Lua):
    it becomes owner's and starts again (True); or, claimed max_attempts times already, it ends failed (False)."""
    if max_attempts is not None and job.attempts >= max_attempts:
        job.status, job.error, job.completed_at = FAILED, attempts_error(job.attempts), now
        job.owner, job.lease_until = None, 0.0
        return False
    job.owner, job.lease_until, job.attempts = owner, now + lease_s, job.attempts + 1
    job.status, job.progress = QUEUED, 0
    return True


def check_changes(changes: dict[str, Any]) -> None:
    """update_job's changes name fields of a job other than id, idempotency_key and service; else ValueError
    (before any is applied)."""
    bad = sorted(name for name in changes if name not in JOB_FIELDS or name in FIXED_FIELDS)
    if bad:
        allowed = ", ".join(sorted(JOB_FIELDS.difference(FIXED_FIELDS)))
        raise ValueError(f"a job has no field {bad[0]!r} to change; allowed: {allowed}")


class StoreError(ValueError):
    """A store that cannot be used as asked: a file of a newer schema or not a database, a server that cannot be
    reached. Its message names the file or host:port (never a password) and is meant to be shown as one line. A
    ValueError, like a malformed URL, so that whatever turns a bad `--state` into one line catches both."""


class TooManyUnfinished(Exception):
    """create_job refused a new job: its service holds `unfinished` queued or running jobs of its kind already."""

    def __init__(self, unfinished: int) -> None:
        super().__init__(f"{unfinished} jobs are queued or running")
        self.unfinished = unfinished


@dataclass
class AdapterRecord:
    name: str
    path: str  # as the client gave it: relative to (or inside) every replica's --lora-dir
    registered_at: float
    deleted_at: float | None = None  # DELETE marks it; replicas refuse it and unload it once idle
    service: str = ""  # the service it belongs to (one registration per service and name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AdapterRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class DeliveryRecord:
    """A job's webhook delivery in the outbox: the exact body every attempt sends (stored once, when the job ends),
    and who is sending it. Only deliveries to come or under way are kept: the outcome is the job's `webhook` state.
    A parked delivery (body "", nobody holding it) is made with the job, so that a process that dies between the
    job's end and storing the body still leaves something for another to take up."""

    job_id: str  # one delivery per job; its webhook-id is "msg_<job_id>"
    url: str
    body: str  # the JSON sent, as text; "" while parked
    created_at: float
    owner: str | None = None  # the sending process; its lease passed, any process may claim it
    lease_until: float = 0.0
    attempts: int = 0  # POSTs made so far (the next waits the retry delay after the last)
    service: str = ""  # its job's service: only that service's processes take it up (they hold its webhook secret)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DeliveryRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def renewed(delivery: DeliveryRecord | None, owner: str, until: float, attempts: int | None,
            body: str | None) -> DeliveryRecord | None:
    """renew_delivery's change (in place) while `owner` holds the delivery; None (nothing changed) otherwise."""
    if delivery is None or delivery.owner != owner:
        return None
    delivery.lease_until = until
    if attempts is not None:
        delivery.attempts = attempts
    if body is not None:
        delivery.body = body
    return delivery


class Store(Protocol):
    """One small interface; every method is atomic on its own. `now()` is the store's clock (seconds since the
    epoch): leases and sweeps are read against it, so replicas on several machines agree as far as their clocks
    do."""

    url: str  # how it was opened, with any password left out

    def now(self) -> float: ...

    # -- jobs --------------------------------------------------------------------------------------------------
    def create_job(self, job: JobRecord, max_unfinished: int | None = None) -> tuple[JobRecord, bool]:
        """Store a new job: (job, True). When job.idempotency_key is set and a job with that key exists already:
        (that job, False), and nothing is written. With `max_unfinished`: TooManyUnfinished, and nothing written,
        when job.service holds that many unfinished jobs of job.kind (counted in the same atomic step)."""

    def get_job(self, job_id: str) -> JobRecord | None: ...

    def list_jobs(self, kind: str | None = None, limit: int = 100, service: str | None = None) -> list[JobRecord]:
        """Newest first (by created_at), at most `limit`; of one service when given."""

    def count_unfinished(self, service: str, kind: str | None = None) -> int:
        """How many jobs of the service (and kind) are queued or running; read from indexes, not documents."""

    def adopt_jobs(self, model: str, service: str) -> int:
        """Give the jobs of before services (service "") made for `model` (their meta["model"]) to `service`; how
        many. A server calls it at start, so that its model's jobs of an upgraded state are its own."""

    def update_job(self, job_id: str, owner: str | None = None, **changes: Any) -> JobRecord | None:
        """Set fields of a job and return it as now stored. With `owner` given, only while that process owns the
        job (else None: the job was taken over or deleted, and the caller must stop). None when there is no job."""

    def claim_job(self, owner: str, lease_s: float, kinds: tuple[str, ...] = KINDS, job_id: str | None = None,
                  service: str | None = None, max_attempts: int | None = None,
                  ended: list[JobRecord] | None = None) -> JobRecord | None:
        """Take one unfinished job that nobody holds (no owner, or a lease that has passed), of one service when
        given: the given one, or else the oldest. It becomes `owner`'s until now() + lease_s, attempts + 1, status
        queued and progress 0 (it starts again). With `max_attempts`: a job claimed that many times already ends
        failed instead (attempts_error), in the same atomic step, and the next one is taken; the jobs it ended so
        are appended to `ended` (their ends are the claimer's to tell). None when there is none."""

    def release_job(self, job_id: str, owner: str, counted: bool = False) -> JobRecord | None:
        """Hand a job back unfinished, as its owner: no owner, queued, claimable at once. Its claim is given back
        too (attempts - 1: a drain, a full engine did not fail on it), unless `counted` (its process died on it:
        the orphans a restarted owner finds; an engine that stopped)."""

    def delete_job(self, job_id: str) -> JobRecord | None:
        """Forget a job (its idempotency key too) and return it as it was; None when there was none. A process
        running it finds out at its next update_job and stops."""

    def sweep(self, finished_before: float) -> list[JobRecord]:
        """Delete the jobs that finished before then; returns them (their result files are the caller's)."""

    # -- adapters registered at run time -------------------------------------------------------------------
    def register_adapter(self, record: AdapterRecord) -> None:
        """Add or replace the registration under (record.service, record.name) (a deleted one comes back)."""

    def adapters(self, service: str | None = None) -> list[AdapterRecord]:
        """Every registration (of one service when given), deleted ones included (until swept), by name."""

    def delete_adapter(self, name: str, service: str = "") -> AdapterRecord | None:
        """Mark the service's registration deleted (deleted_at = now()); None when there is none or it was deleted
        already."""

    def sweep_adapters(self, deleted_before: float) -> int:
        """Forget the registrations deleted before then (every process has acted on them by now); how many."""

    # -- replicas ----------------------------------------------------------------------------------------------
    def publish(self, replica: str, info: dict[str, Any], ttl_s: float) -> None:
        """What a replica says about itself (adapters held, jobs running, ...), kept for ttl_s unless published
        again."""

    def replicas(self) -> dict[str, dict[str, Any]]:
        """The replicas whose publication has not expired, each with its latest info."""

    def close(self) -> None: ...

    # -- the webhook outbox (jobs/webhooks.py) -----------------------------------------------------------------
    def create_delivery(self, delivery: DeliveryRecord) -> bool:
        """Store a job's one delivery as given (its owner and lease too): True. When the job has one already: a
        parked one that nobody holds (body "", no owner or a lease that has passed) takes this one's body, owner and
        lease (True); any other stays as it is (False: a second notification of the same end, or another process
        took it up first)."""

    def get_delivery(self, job_id: str) -> DeliveryRecord | None: ...

    def claim_delivery(self, owner: str, lease_s: float, job_id: str | None = None,
                       service: str | None = None) -> DeliveryRecord | None:
        """Take a delivery whose lease has passed (its sender died) and whose job has ended or is gone (a parked
        one waits for its job): the given one, or else the one whose lease ended first; with `service`, only one of
        that service (another service's server signs with another secret) or of none (made before services). It becomes `owner`'s until
        now() + lease_s. None when there is none."""

    def renew_delivery(self, job_id: str, owner: str, lease_s: float, attempts: int | None = None,
                       body: str | None = None) -> DeliveryRecord | None:
        """While `owner` holds it: its lease to now() + lease_s (and its attempts and body, when given). Else None:
        it was taken over or ended, and the caller must stop."""

    def end_delivery(self, job_id: str, owner: str | None = None) -> bool:
        """Forget a delivery (delivered, failed, or its job gone): with `owner`, only while that process holds it.
        Whether one was forgotten."""
