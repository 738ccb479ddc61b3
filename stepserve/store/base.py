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

from dataclasses import asdict, dataclass, field, fields
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
FIXED_FIELDS = ("id", "idempotency_key")  # set at creation, never changed


def check_changes(changes: dict[str, Any]) -> None:
    """update_job's changes name fields of a job other than id and idempotency_key; else ValueError (before any
    is applied)."""
    bad = sorted(name for name in changes if name not in JOB_FIELDS or name in FIXED_FIELDS)
    if bad:
        allowed = ", ".join(sorted(JOB_FIELDS.difference(FIXED_FIELDS)))
        raise ValueError(f"a job has no field {bad[0]!r} to change; allowed: {allowed}")


class StoreError(ValueError):
    """A store that cannot be used as asked: a file of a newer schema or not a database, a server that cannot be
    reached. Its message names the file or host:port (never a password) and is meant to be shown as one line. A
    ValueError, like a malformed URL, so that whatever turns a bad `--state` into one line catches both."""


@dataclass
class AdapterRecord:
    name: str
    path: str  # as the client gave it: relative to (or inside) every replica's --lora-dir
    registered_at: float
    deleted_at: float | None = None  # DELETE marks it; replicas refuse it and unload it once idle

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DeliveryRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class Store(Protocol):
    """One small interface; every method is atomic on its own. `now()` is the store's clock (seconds since the
    epoch): leases and sweeps are read against it, so replicas on several machines agree as far as their clocks
    do."""

    url: str  # how it was opened, with any password left out

    def now(self) -> float: ...

    # -- jobs --------------------------------------------------------------------------------------------------
    def create_job(self, job: JobRecord) -> tuple[JobRecord, bool]:
        """Store a new job: (job, True). When job.idempotency_key is set and a job with that key exists already:
        (that job, False), and nothing is written."""

    def get_job(self, job_id: str) -> JobRecord | None: ...

    def list_jobs(self, kind: str | None = None, limit: int = 100) -> list[JobRecord]:
        """Newest first (by created_at), at most `limit`."""

    def update_job(self, job_id: str, owner: str | None = None, **changes: Any) -> JobRecord | None:
        """Set fields of a job and return it as now stored. With `owner` given, only while that process owns the
        job (else None: the job was taken over or deleted, and the caller must stop). None when there is no job."""

    def claim_job(self, owner: str, lease_s: float, kinds: tuple[str, ...] = KINDS,
                  job_id: str | None = None) -> JobRecord | None:
        """Take one unfinished job that nobody holds (no owner, or a lease that has passed): the given one, or else
        the oldest. It becomes `owner`'s until now() + lease_s, attempts + 1, status queued and progress 0 (it
        starts again). None when there is none."""

    def release_job(self, job_id: str, owner: str) -> JobRecord | None:
        """Hand a job back unfinished (a draining process): no owner, queued, claimable at once."""

    def delete_job(self, job_id: str) -> JobRecord | None:
        """Forget a job (its idempotency key too) and return it as it was; None when there was none. A process
        running it finds out at its next update_job and stops."""

    def sweep(self, finished_before: float) -> list[JobRecord]:
        """Delete the jobs that finished before then; returns them (their result files are the caller's)."""

    # -- adapters registered at run time -------------------------------------------------------------------
    def register_adapter(self, record: AdapterRecord) -> None:
        """Add or replace the registration under record.name (a deleted one comes back)."""

    def adapters(self) -> list[AdapterRecord]:
        """Every registration, deleted ones included (until swept), by name."""

    def delete_adapter(self, name: str) -> AdapterRecord | None:
        """Mark a registration deleted (deleted_at = now()); None when there is none or it was deleted already."""

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

    def claim_delivery(self, owner: str, lease_s: float, job_id: str | None = None) -> DeliveryRecord | None:
        """Take a delivery whose lease has passed (its sender died) and whose job has ended or is gone (a parked
        one waits for its job): the given one, or else the one whose lease ended first. It becomes `owner`'s until
        now() + lease_s. None when there is none."""

    def renew_delivery(self, job_id: str, owner: str, lease_s: float, attempts: int | None = None,
                       body: str | None = None) -> DeliveryRecord | None:
        """While `owner` holds it: its lease to now() + lease_s (and its attempts and body, when given). Else None:
        it was taken over or ended, and the caller must stop."""

    def end_delivery(self, job_id: str, owner: str | None = None) -> bool:
        """Forget a delivery (delivered, failed, or its job gone): with `owner`, only while that process holds it.
        Whether one was forgotten."""
