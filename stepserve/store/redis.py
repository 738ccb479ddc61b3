"""The state store in Redis (`redis://[:PASSWORD@]HOST:PORT/DB`, `rediss://` for TLS): replicas on several machines.

Every key starts with a prefix (`stepserve:` unless told otherwise), so a shared Redis can hold other things:
  job:ID       a hash, one JSON value per JobRecord field (and `_idem`: the key of its idempotency entry)
  jobs, jobs:KIND   every job / every job of a kind, scored by created_at (list_jobs)
  open         the unfinished jobs, scored by created_at (claim_job without a service scans it, oldest first)
  done         the finished jobs, scored by completed_at (sweep)
  svc:SERVICE:jobs, svc:SERVICE:jobs:KIND, svc:SERVICE:open:KIND   the same, of one service (its listing, its claim
               and its count of unfinished jobs: ZCARD, no document read)
  idem:KEY     an idempotency key's job id
  adapter:SERVICE/NAME a hash, one JSON value per AdapterRecord field; adapters: their SERVICE/NAMEs
  replica:NAME a replica's publication (expires by itself); replicas: the names, scored by when they expire

Every method that reads and then writes is one Lua script, which Redis runs atomically. Not WATCH/MULTI: that is
optimistic, so replicas claiming at the same moment would retry in a loop, one round trip per try, and the claim
scan reads keys it cannot know before it starts. A script takes one round trip, never retries, and reads the
server's own clock (TIME), so that replicas on several machines agree on leases whatever their own clocks say.
The scripts build key names from the prefix: a standalone Redis (or a primary with replicas), not Redis Cluster.
All JSON is written by Python (the scripts only compare and copy it; numbers they make are printed with 17 digits).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from ..util.extras import require_extra
from ..util.urls import without_password
from .base import (KINDS, RELEASED, AdapterRecord, DeliveryRecord, JobRecord, StoreError, TooManyUnfinished,
                   check_changes)
from .redis_outbox import OUTBOX_COMMON, OUTBOX_SCRIPTS
from .redis_scripts import COMMON, SCRIPTS

PREFIX = "stepserve:"


def _fields(record: JobRecord | AdapterRecord) -> list[str]:
    return [item for name, value in record.to_dict().items() for item in (name, json.dumps(value))]


def _decode(cls, flat: list[str] | None):
    if not flat:
        return None
    pairs = iter(flat)
    return cls.from_dict({name: json.loads(value) for name, value in zip(pairs, pairs) if not name.startswith("_")})


class RedisStore:
    def __init__(self, url: str, prefix: str = PREFIX, connect_timeout_s: float = 5.0,
                 timeout_s: float = 30.0) -> None:
        self.url = without_password(url)
        scheme = urlsplit(url).scheme or "redis"
        require_extra("redis", f"--state {scheme}://...", "redis")
        import redis

        self.prefix = prefix
        secret = urlsplit(url).password
        try:
            parts = urlsplit(url)
            where = f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
            self._redis = redis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=connect_timeout_s,
                                               socket_timeout=timeout_s)
        except ValueError as exc:
            raise ValueError(f"state {self.url}: {_scrub(str(exc), secret)}") from None
        try:
            self._redis.ping()
        except redis.RedisError as exc:
            self._redis.close()
            raise StoreError(f"state {self.url}: cannot reach Redis at {where}: {_scrub(str(exc), secret)}") from None
        self._scripts = {name: self._redis.register_script(COMMON + body) for name, body in SCRIPTS.items()}

    def _run(self, script: str, *args: Any):
        return self._scripts[script](args=(self.prefix, *args))

    def now(self) -> float:
        seconds, micros = self._redis.time()
        return seconds + micros / 1e6

    def create_job(self, job: JobRecord, max_unfinished: int | None = None) -> tuple[JobRecord, bool]:
        fields = _fields(job)
        idem = "" if job.idempotency_key is None else f"{self.prefix}idem:{job.idempotency_key}"
        bound = "" if max_unfinished is None else str(int(max_unfinished))
        answer = self._run("create", job.id, idem, bound, f"{self.prefix}svc:{job.service}:open:{job.kind}", *fields)
        if answer[0] == 0:
            return _decode(JobRecord, answer[1]), False
        if answer[0] == -1:
            raise ValueError(f"job {job.id!r} exists already")
        if answer[0] == -2:
            raise TooManyUnfinished(int(answer[1]))
        return _decode(JobRecord, fields), True

    def adopt_jobs(self, model: str, service: str) -> int:
        return int(self._run("adopt", model, json.dumps(service), *KINDS))

    def count_unfinished(self, service: str, kind: str | None = None) -> int:
        return int(self._run("count", service, *((kind,) if kind is not None else KINDS)))

    def get_job(self, job_id: str) -> JobRecord | None:
        found = self._redis.hgetall(f"{self.prefix}job:{job_id}")
        return _decode(JobRecord, [item for pair in found.items() for item in pair])

    def list_jobs(self, kind: str | None = None, limit: int = 100, service: str | None = None) -> list[JobRecord]:
        if limit <= 0:
            return []
        scope = () if service is None else (service,)
        return [_decode(JobRecord, flat) for flat in self._run("list", kind or "", limit, *scope) if flat]

    def update_job(self, job_id: str, owner: str | None = None, **changes: Any) -> JobRecord | None:
        check_changes(changes)
        return self._update(job_id, owner, changes)

    def _update(self, job_id: str, owner: str | None, changes: dict[str, Any]) -> JobRecord | None:
        fence = "" if owner is None else json.dumps(owner)
        pairs = [item for name, value in changes.items() for item in (name, json.dumps(value))]
        return _decode(JobRecord, self._run("update", job_id, fence, *pairs))

    def claim_job(self, owner: str, lease_s: float, kinds: tuple[str, ...] = KINDS, job_id: str | None = None,
                  service: str | None = None, max_attempts: int | None = None,
                  ended: list[JobRecord] | None = None) -> JobRecord | None:
        scope = "" if service is None else json.dumps(service)
        most = "" if max_attempts is None else str(int(max_attempts))
        claimed, *failed = self._run("claim", json.dumps(owner), repr(float(lease_s)), job_id or "", scope, most,
                                     *kinds)
        if ended is not None:
            ended.extend(_decode(JobRecord, flat) for flat in failed)
        return None if claimed == 0 else _decode(JobRecord, claimed)

    def release_job(self, job_id: str, owner: str, counted: bool = False) -> JobRecord | None:
        pairs = [item for name, value in RELEASED.items() for item in (name, json.dumps(value))]
        return _decode(JobRecord, self._run("release", job_id, json.dumps(owner), "1" if counted else "0", *pairs))

    def delete_job(self, job_id: str) -> JobRecord | None:
        return _decode(JobRecord, self._run("delete", job_id))

    def sweep(self, finished_before: float) -> list[JobRecord]:
        return [_decode(JobRecord, flat) for flat in self._run("sweep", repr(float(finished_before)))]

    def register_adapter(self, record: AdapterRecord) -> None:
        self._run("register", _adapter_key(record.service, record.name), *_fields(record))

    def adapters(self, service: str | None = None) -> list[AdapterRecord]:
        found = [_decode(AdapterRecord, flat)
                 for flat in self._run("adapters", "" if service is None else json.dumps(service)) if flat]
        return sorted(found, key=lambda r: (r.name, r.service))

    def delete_adapter(self, name: str, service: str = "") -> AdapterRecord | None:
        return _decode(AdapterRecord, self._run("delete_adapter", _adapter_key(service, name)))

    def sweep_adapters(self, deleted_before: float) -> int:
        return int(self._run("sweep_adapters", repr(float(deleted_before))))

    def publish(self, replica: str, info: dict[str, Any], ttl_s: float) -> None:
        self._run("publish", replica, json.dumps(info), repr(float(ttl_s)))

    def replicas(self) -> dict[str, dict[str, Any]]:
        flat = self._run("replicas")
        pairs = iter(flat)
        return {name: json.loads(info) for name, info in sorted(zip(pairs, pairs))}

    def close(self) -> None:
        self._redis.close()

    # -- the webhook outbox (base.py; its keys and scripts: redis_outbox.py) ----------------------
    def _outbox(self, script: str, *args: Any):
        scripts = self.__dict__.setdefault("_outbox_scripts", {})  # registered on first use
        if script not in scripts:
            scripts[script] = self._redis.register_script(COMMON + OUTBOX_COMMON + OUTBOX_SCRIPTS[script])
        return scripts[script](args=(self.prefix, *args))

    def create_delivery(self, delivery: DeliveryRecord) -> bool:
        doc = json.dumps({k: v for k, v in delivery.to_dict().items() if k not in _OWN_FIELDS})
        return bool(self._outbox("create_delivery", delivery.job_id, doc, delivery.body, json.dumps(delivery.owner),
                                 repr(float(delivery.lease_until)), str(int(delivery.attempts))))

    def get_delivery(self, job_id: str) -> DeliveryRecord | None:
        return _delivery(self._redis.hgetall(f"{self.prefix}delivery:{job_id}"))

    def claim_delivery(self, owner: str, lease_s: float, job_id: str | None = None,
                       service: str | None = None) -> DeliveryRecord | None:
        return _delivery(self._outbox("claim_delivery", json.dumps(owner), repr(float(lease_s)), job_id or "",
                                      "0" if service is None else "1", service or ""))

    def renew_delivery(self, job_id: str, owner: str, lease_s: float, attempts: int | None = None,
                       body: str | None = None) -> DeliveryRecord | None:
        return _delivery(self._outbox("renew_delivery", job_id, json.dumps(owner), repr(float(lease_s)),
                                      "" if attempts is None else str(int(attempts)), body or "",
                                      "0" if body is None else "1"))

    def end_delivery(self, job_id: str, owner: str | None = None) -> bool:
        return bool(self._outbox("end_delivery", job_id, "" if owner is None else json.dumps(owner)))


_OWN_FIELDS = ("body", "owner", "lease_until", "attempts")  # a delivery's hash fields besides its doc


def _delivery(found) -> DeliveryRecord | None:
    """A delivery from its hash (a dict, or HGETALL's flat list from a script)."""
    if not found:
        return None
    if isinstance(found, list):
        pairs = iter(found)
        found = dict(zip(pairs, pairs))
    return DeliveryRecord.from_dict({**json.loads(found["doc"]), "body": found["body"], "owner": json.loads(found["owner"]),
                                     "lease_until": float(found["lease_until"]), "attempts": int(found["attempts"])})


def _adapter_key(service: str, name: str) -> str:
    """SERVICE/NAME (a service name has no "/"); a registration of the service "" keeps the key of before: NAME."""
    return f"{service}/{name}" if service else name


def _scrub(message: str, secret: str | None) -> str:
    return message.replace(secret, "***") if secret else message
