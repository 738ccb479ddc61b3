"""The state store in one SQLite file (`sqlite:///PATH`, the default: state.db in the user's state directory).

Processes and replicas on one machine share the file: WAL mode (readers never wait for the writer), a busy timeout
(sqlite3's `timeout`: a writer waits for another instead of failing), and every method that writes is one `BEGIN IMMEDIATE`
transaction, so that two processes never claim the same job. One connection per process, used by one thread at a
time (a lock); a process forked with a store open opens its own connection on first use.

A job is one JSON document per row (JobRecord.to_dict), with the fields that are queried copied into indexed
columns. `PRAGMA user_version` holds the schema version, so that a later release can migrate the file; a file of a
newer schema is refused with an error that names it. synchronous=NORMAL: a commit survives the process being
killed; the last commits may be lost if the machine loses power.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .base import (KINDS, AdapterRecord, JobRecord, StoreError, TooManyUnfinished, check_changes,
                   release, take)
from .sqlite_outbox import SqliteOutbox

from .sqlite_schema import SCHEMA, TABLES, TO_2, UNFINISHED, claim_query  # noqa: F401 (the tests read them)


def _dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"))


def _job(doc: str) -> JobRecord:
    return JobRecord.from_dict(json.loads(doc))


def _adapter(doc: str) -> AdapterRecord:
    return AdapterRecord.from_dict(json.loads(doc))


class SqliteStore(SqliteOutbox):
    def __init__(self, path: str | os.PathLike, clock: Callable[[], float] = time.time,
                 busy_timeout_s: float = 30.0) -> None:
        if not str(path):
            raise ValueError("state sqlite:///PATH: the path is empty (e.g. sqlite:///var/stepserve/state.db)")
        self.path = Path(path)
        self.url = f"sqlite:///{path}"
        self._clock = clock
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"state {self.url}: cannot create the folder {self.path.parent}: "
                             f"{exc.strerror or exc}") from None
        with self._lock:
            self._connection()

    # -- the connection and its transactions -------------------------------------------------------------------
    def _connection(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():  # a forked child never uses its parent's connection
            self._conn, self._pid = self._open(), os.getpid()
        return self._conn

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=self._busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.Error as exc:
            raise StoreError(f"state {self.url}: cannot open {self.path}: {exc}") from None
        try:
            self.journal_mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate(conn)
        except sqlite3.OperationalError as exc:  # read-only, locked past the timeout, disk full...
            conn.close()
            raise StoreError(f"state {self.url}: cannot use {self.path}: {exc}") from None
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise StoreError(f"state {self.url}: {self.path} is not a stepserve state file ({exc})") from None
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        """Create the tables in a new file, bring a file of schema 1 to 2 (TO_2); refuse a file of a newer schema."""
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA:
                raise StoreError(f"state {self.url}: {self.path} has state schema {version}, newer than this "
                                 f"release reads ({SCHEMA}): upgrade stepserve, or give --state another file")
            steps = (*TABLES, *TO_2) if version == 0 else TO_2 if version == 1 else ()
            for statement in steps:
                conn.execute(statement)
            if steps:
                conn.execute(f"PRAGMA user_version = {SCHEMA}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction that holds the file's write lock from its start (BEGIN IMMEDIATE): what it reads is
        what it changes, whatever other processes do."""
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._connection().execute(sql, args).fetchall()

    @staticmethod
    def _save(conn: sqlite3.Connection, job: JobRecord, insert: bool = False) -> str:
        doc = _dumps(job.to_dict())
        columns = (job.kind, job.status, job.owner, job.lease_until, job.created_at, job.completed_at)
        if insert:
            conn.execute("INSERT INTO jobs (kind, status, owner, lease_until, created_at, completed_at, doc, id, "
                         "idempotency_key, service) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (*columns, doc, job.id, job.idempotency_key, job.service))
        else:
            conn.execute("UPDATE jobs SET kind = ?, status = ?, owner = ?, lease_until = ?, created_at = ?, "
                         "completed_at = ?, doc = ? WHERE id = ?", (*columns, doc, job.id))
        return doc

    @staticmethod
    def _get(conn: sqlite3.Connection, job_id: str) -> JobRecord | None:
        row = conn.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row[0])

    # -- the Store interface (base.py) -------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock()

    def create_job(self, job: JobRecord, max_unfinished: int | None = None) -> tuple[JobRecord, bool]:
        with self._write() as conn:
            if job.idempotency_key is not None:
                row = conn.execute("SELECT doc FROM jobs WHERE idempotency_key = ?", (job.idempotency_key,)).fetchone()
                if row is not None:
                    return _job(row[0]), False
            if conn.execute("SELECT 1 FROM jobs WHERE id = ?", (job.id,)).fetchone() is not None:
                raise ValueError(f"job {job.id!r} exists already")
            if max_unfinished is not None:
                unfinished = self._count(conn, job.service, job.kind)
                if unfinished >= max_unfinished:
                    raise TooManyUnfinished(unfinished)
            return _job(self._save(conn, job, insert=True)), True

    @staticmethod
    def _count(conn: sqlite3.Connection, service: str, kind: str | None) -> int:
        where, args = ("AND kind = ?", (kind,)) if kind is not None else ("", ())
        return conn.execute(f"SELECT COUNT(*) FROM jobs WHERE service = ? {where} AND {UNFINISHED}",
                            (service, *args)).fetchone()[0]

    def adopt_jobs(self, model: str, service: str) -> int:
        with self._write() as conn:
            return conn.execute("UPDATE jobs SET service = ?, doc = json_set(doc, '$.service', ?) WHERE service = '' "
                                "AND json_extract(doc, '$.meta.model') = ?", (service, service, model)).rowcount

    def count_unfinished(self, service: str, kind: str | None = None) -> int:
        with self._lock:
            return self._count(self._connection(), service, kind)

    def get_job(self, job_id: str) -> JobRecord | None:
        rows = self._read("SELECT doc FROM jobs WHERE id = ?", (job_id,))
        return _job(rows[0][0]) if rows else None

    def list_jobs(self, kind: str | None = None, limit: int = 100, service: str | None = None) -> list[JobRecord]:
        tests = [(test, value) for test, value in (("service = ?", service), ("kind = ?", kind)) if value is not None]
        where = "WHERE " + " AND ".join(test for test, _ in tests) if tests else ""
        rows = self._read(f"SELECT doc FROM jobs {where} ORDER BY created_at DESC, rowid DESC LIMIT ?",
                          (*(value for _, value in tests), max(limit, 0)))
        return [_job(doc) for doc, in rows]

    def update_job(self, job_id: str, owner: str | None = None, **changes: Any) -> JobRecord | None:
        check_changes(changes)
        return self._update(job_id, owner, changes)

    def _update(self, job_id: str, owner: str | None, changes: dict[str, Any]) -> JobRecord | None:
        with self._write() as conn:
            job = self._get(conn, job_id)
            if job is None or (owner is not None and job.owner != owner):
                return None
            for name, value in changes.items():
                setattr(job, name, value)
            return _job(self._save(conn, job))

    def claim_job(self, owner: str, lease_s: float, kinds: tuple[str, ...] = KINDS, job_id: str | None = None,
                  service: str | None = None, max_attempts: int | None = None,
                  ended: list[JobRecord] | None = None) -> JobRecord | None:
        with self._write() as conn:
            now = self._clock()
            args = (*(() if job_id is None else (job_id,)), *(() if service is None else (service,)), *kinds, now)
            query = claim_query(len(kinds), job_id is not None, service is not None)
            while (row := conn.execute(query, args).fetchone()) is not None:
                job = _job(row[0])
                claimed = take(job, owner, now, lease_s, max_attempts)
                self._save(conn, job)
                if claimed:
                    return job
                if ended is not None:
                    ended.append(job)
            return None

    def release_job(self, job_id: str, owner: str, counted: bool = False) -> JobRecord | None:
        with self._write() as conn:
            job = self._get(conn, job_id)
            if job is None or job.owner != owner:
                return None
            release(job, counted)
            return _job(self._save(conn, job))

    def delete_job(self, job_id: str) -> JobRecord | None:
        with self._write() as conn:
            job = self._get(conn, job_id)
            if job is not None:
                conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            return job

    def sweep(self, finished_before: float) -> list[JobRecord]:
        with self._write() as conn:
            rows = conn.execute(f"SELECT id, doc FROM jobs WHERE NOT ({UNFINISHED}) AND completed_at IS NOT NULL "
                                "AND completed_at < ?", (finished_before,)).fetchall()
            conn.executemany("DELETE FROM jobs WHERE id = ?", [(job_id,) for job_id, _ in rows])
            return [_job(doc) for _, doc in rows]

    def register_adapter(self, record: AdapterRecord) -> None:
        with self._write() as conn:
            conn.execute("INSERT OR REPLACE INTO adapters (service, name, deleted_at, doc) VALUES (?, ?, ?, ?)",
                         (record.service, record.name, record.deleted_at, _dumps(record.to_dict())))

    def adapters(self, service: str | None = None) -> list[AdapterRecord]:
        where, args = ("WHERE service = ?", (service,)) if service is not None else ("", ())
        return [_adapter(doc) for doc, in self._read(f"SELECT doc FROM adapters {where} ORDER BY name, service",
                                                     args)]

    def delete_adapter(self, name: str, service: str = "") -> AdapterRecord | None:
        with self._write() as conn:
            row = conn.execute("SELECT doc FROM adapters WHERE service = ? AND name = ? AND deleted_at IS NULL",
                               (service, name)).fetchone()
            if row is None:
                return None
            record = _adapter(row[0])
            record.deleted_at = self._clock()
            conn.execute("UPDATE adapters SET deleted_at = ?, doc = ? WHERE service = ? AND name = ?",
                         (record.deleted_at, _dumps(record.to_dict()), service, name))
            return record

    def sweep_adapters(self, deleted_before: float) -> int:
        with self._write() as conn:
            return conn.execute("DELETE FROM adapters WHERE deleted_at < ?", (deleted_before,)).rowcount

    def publish(self, replica: str, info: dict[str, Any], ttl_s: float) -> None:
        with self._write() as conn:
            now = self._clock()
            conn.execute("DELETE FROM replicas WHERE expires_at < ?", (now,))
            conn.execute("INSERT OR REPLACE INTO replicas (replica, expires_at, info) VALUES (?, ?, ?)",
                         (replica, now + ttl_s, _dumps(info)))

    def replicas(self) -> dict[str, dict[str, Any]]:
        rows = self._read("SELECT replica, info FROM replicas WHERE expires_at >= ? ORDER BY replica",
                          (self._clock(),))
        return {replica: json.loads(info) for replica, info in rows}

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
