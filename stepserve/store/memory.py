"""The store in this process's memory (`--state memory`): today's behaviour, nothing survives a restart. Also the
reference the other backends are tested against (tests/store: one contract, every backend)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

from .base import (FINISHED, KINDS, AdapterRecord, DeliveryRecord, JobRecord, TooManyUnfinished,
                   check_changes, release, renewed, take)


class MemoryStore:
    url = "memory"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}
        self._keys: dict[str, str] = {}  # idempotency key -> job id
        self._adapters: dict[tuple[str, str], AdapterRecord] = {}  # (service, name) -> registration
        self._replicas: dict[str, tuple[float, dict[str, Any]]] = {}  # replica -> (expires at, info)

    def now(self) -> float:
        return self._clock()

    def create_job(self, job: JobRecord, max_unfinished: int | None = None) -> tuple[JobRecord, bool]:
        with self._lock:
            if job.idempotency_key is not None and job.idempotency_key in self._keys:
                return copy.deepcopy(self._jobs[self._keys[job.idempotency_key]]), False
            if job.id in self._jobs:
                raise ValueError(f"job {job.id!r} exists already")
            if max_unfinished is not None:
                unfinished = self._unfinished(job.service, job.kind)
                if unfinished >= max_unfinished:
                    raise TooManyUnfinished(unfinished)
            self._jobs[job.id] = copy.deepcopy(job)
            if job.idempotency_key is not None:
                self._keys[job.idempotency_key] = job.id
            return copy.deepcopy(job), True

    def get_job(self, job_id: str) -> JobRecord | None:
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else copy.deepcopy(job)

    def list_jobs(self, kind: str | None = None, limit: int = 100, service: str | None = None) -> list[JobRecord]:
        with self._lock:
            jobs = [j for j in self._jobs.values()
                    if (kind is None or j.kind == kind) and (service is None or j.service == service)]
            jobs.sort(key=lambda j: j.created_at, reverse=True)
            return [copy.deepcopy(j) for j in jobs[:max(limit, 0)]]

    def count_unfinished(self, service: str, kind: str | None = None) -> int:
        with self._lock:
            return self._unfinished(service, kind)

    def adopt_jobs(self, model: str, service: str) -> int:
        with self._lock:
            found = [j for j in self._jobs.values() if j.service == "" and j.meta.get("model") == model]
            for job in found:
                job.service = service
            return len(found)

    def _unfinished(self, service: str, kind: str | None) -> int:
        return sum(1 for j in self._jobs.values()
                   if j.service == service and (kind is None or j.kind == kind) and j.status not in FINISHED)

    def update_job(self, job_id: str, owner: str | None = None, **changes: Any) -> JobRecord | None:
        check_changes(changes)
        return self._update(job_id, owner, changes)

    def _update(self, job_id: str, owner: str | None, changes: dict[str, Any]) -> JobRecord | None:
        """update_job with the changes as a dict."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or (owner is not None and job.owner != owner):
                return None
            for name, value in changes.items():
                setattr(job, name, copy.deepcopy(value))
            return copy.deepcopy(job)

    def claim_job(self, owner: str, lease_s: float, kinds: tuple[str, ...] = KINDS, job_id: str | None = None,
                  service: str | None = None, max_attempts: int | None = None,
                  ended: list[JobRecord] | None = None) -> JobRecord | None:
        with self._lock:
            now = self._clock()
            candidates = [self._jobs[job_id]] if job_id in self._jobs else [] if job_id else \
                sorted(self._jobs.values(), key=lambda j: j.created_at)
            for job in candidates:
                if job.kind in kinds and job.status not in FINISHED and (job.owner is None or job.lease_until < now) \
                        and (service is None or job.service == service):
                    if take(job, owner, now, lease_s, max_attempts):
                        return copy.deepcopy(job)
                    if ended is not None:
                        ended.append(copy.deepcopy(job))
            return None

    def release_job(self, job_id: str, owner: str, counted: bool = False) -> JobRecord | None:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.owner != owner:
                return None
            release(job, counted)
            return copy.deepcopy(job)

    def delete_job(self, job_id: str) -> JobRecord | None:
        with self._lock:
            job = self._jobs.pop(job_id, None)
            if job is not None and job.idempotency_key is not None:
                self._keys.pop(job.idempotency_key, None)
            return job

    def sweep(self, finished_before: float) -> list[JobRecord]:
        with self._lock:
            old = [j.id for j in self._jobs.values()
                   if j.status in FINISHED and j.completed_at is not None and j.completed_at < finished_before]
        return [job for job in map(self.delete_job, old) if job is not None]

    def register_adapter(self, record: AdapterRecord) -> None:
        with self._lock:
            self._adapters[record.service, record.name] = copy.deepcopy(record)

    def adapters(self, service: str | None = None) -> list[AdapterRecord]:
        with self._lock:
            found = [r for r in self._adapters.values() if service is None or r.service == service]
            return [copy.deepcopy(r) for r in sorted(found, key=lambda r: (r.name, r.service))]

    def delete_adapter(self, name: str, service: str = "") -> AdapterRecord | None:
        with self._lock:
            record = self._adapters.get((service, name))
            if record is None or record.deleted_at is not None:
                return None
            record.deleted_at = self._clock()
            return copy.deepcopy(record)

    def sweep_adapters(self, deleted_before: float) -> int:
        with self._lock:
            old = [k for k, r in self._adapters.items() if r.deleted_at is not None and r.deleted_at < deleted_before]
            for key in old:
                del self._adapters[key]
            return len(old)

    def publish(self, replica: str, info: dict[str, Any], ttl_s: float) -> None:
        with self._lock:
            self._replicas[replica] = (self._clock() + ttl_s, copy.deepcopy(info))

    def replicas(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            now = self._clock()
            return {r: copy.deepcopy(info) for r, (until, info) in sorted(self._replicas.items()) if until >= now}

    def close(self) -> None:
        pass

    # -- the webhook outbox (base.py) --------------------------------------------------------------------------
    def _outbox(self) -> dict[str, DeliveryRecord]:
        """The deliveries by job id (made on first use, so that the outbox stays one block of its own)."""
        return self.__dict__.setdefault("_deliveries", {})

    def create_delivery(self, delivery: DeliveryRecord) -> bool:
        with self._lock:
            there = self._outbox().get(delivery.job_id)
            if there is not None and (there.body or (there.owner is not None and there.lease_until >= self._clock())):
                return False
            self._outbox()[delivery.job_id] = copy.deepcopy(delivery)
            return True

    def get_delivery(self, job_id: str) -> DeliveryRecord | None:
        with self._lock:
            return copy.deepcopy(self._outbox().get(job_id))

    def claim_delivery(self, owner: str, lease_s: float, job_id: str | None = None,
                       service: str | None = None) -> DeliveryRecord | None:
        with self._lock:
            now = self._clock()
            box = self._outbox()
            candidates = [box[job_id]] if job_id in box else [] if job_id else \
                sorted(box.values(), key=lambda d: d.lease_until)
            for delivery in candidates:
                job = self._jobs.get(delivery.job_id)
                if service is not None and delivery.service not in (service, ""):  # "": made before services
                    continue
                if delivery.lease_until < now and (job is None or job.status in FINISHED):
                    delivery.owner, delivery.lease_until = owner, now + lease_s
                    return copy.deepcopy(delivery)
            return None

    def renew_delivery(self, job_id: str, owner: str, lease_s: float, attempts: int | None = None,
                       body: str | None = None) -> DeliveryRecord | None:
        with self._lock:
            delivery = renewed(self._outbox().get(job_id), owner, self._clock() + lease_s, attempts, body)
            return None if delivery is None else copy.deepcopy(delivery)

    def end_delivery(self, job_id: str, owner: str | None = None) -> bool:
        with self._lock:
            delivery = self._outbox().get(job_id)
            if delivery is None or (owner is not None and delivery.owner != owner):
                return False
            del self._outbox()[job_id]
            return True
