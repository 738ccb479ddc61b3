"""The webhook outbox of the SQLite store (sqlite.py; the methods: base.py's Store): its own table, `deliveries`,
made on first use in any file (one of an earlier release gains it then: the table is only added, so the schema
version is unchanged). A row is the delivery's document, with its owner and lease as columns; every method is one
`BEGIN IMMEDIATE` transaction of the store's, so a claim is atomic across processes. A claim joins the jobs table:
a parked delivery waits until its job has ended (or is gone)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from .base import DeliveryRecord, renewed

ENDED = "j.status IN ('completed', 'failed')"  # a job of the jobs table (sqlite.py) that has ended
OUTBOX = ("CREATE TABLE IF NOT EXISTS deliveries (job_id TEXT PRIMARY KEY, owner TEXT, lease_until REAL NOT NULL, "
          "doc TEXT NOT NULL)",
          "CREATE INDEX IF NOT EXISTS deliveries_by_lease ON deliveries (lease_until)")


class SqliteOutbox:
    """Mixed into SqliteStore, whose `_write()` transactions and clock it uses."""

    @contextmanager
    def _outbox(self) -> Iterator[sqlite3.Connection]:
        with self._write() as conn:
            if getattr(self, "_outbox_made", None) != id(conn):
                for statement in OUTBOX:
                    conn.execute(statement)
                self._outbox_made = id(conn)
            yield conn

    @staticmethod
    def _put_delivery(conn: sqlite3.Connection, delivery: DeliveryRecord) -> DeliveryRecord:
        doc = json.dumps(delivery.to_dict(), separators=(",", ":"))
        conn.execute("INSERT OR REPLACE INTO deliveries (job_id, owner, lease_until, doc) VALUES (?, ?, ?, ?)",
                     (delivery.job_id, delivery.owner, delivery.lease_until, doc))
        return delivery

    @staticmethod
    def _get_delivery(conn: sqlite3.Connection, job_id: str) -> DeliveryRecord | None:
        row = conn.execute("SELECT doc FROM deliveries WHERE job_id = ?", (job_id,)).fetchone()
        return None if row is None else DeliveryRecord.from_dict(json.loads(row[0]))

    def create_delivery(self, delivery: DeliveryRecord) -> bool:
        with self._outbox() as conn:
            there = self._get_delivery(conn, delivery.job_id)
            if there is not None and (there.body or (there.owner is not None and there.lease_until >= self._clock())):
                return False
            self._put_delivery(conn, delivery)
            return True

    def get_delivery(self, job_id: str) -> DeliveryRecord | None:
        with self._outbox() as conn:
            return self._get_delivery(conn, job_id)

    def claim_delivery(self, owner: str, lease_s: float, job_id: str | None = None,
                       service: str | None = None) -> DeliveryRecord | None:
        with self._outbox() as conn:
            now = self._clock()
            which = ("d.job_id = ? AND " if job_id is not None else "") + (
                "coalesce(json_extract(d.doc, '$.service'), '') IN (?, '') AND " if service is not None else "")
            given = tuple(v for v in (job_id, service) if v is not None)
            row = conn.execute(f"SELECT d.doc FROM deliveries d LEFT JOIN jobs j ON j.id = d.job_id WHERE {which}"
                               f"d.lease_until < ? AND (j.id IS NULL OR {ENDED}) "
                               "ORDER BY d.lease_until LIMIT 1", (*given, now)).fetchone()
            if row is None:
                return None
            delivery = DeliveryRecord.from_dict(json.loads(row[0]))
            delivery.owner, delivery.lease_until = owner, now + lease_s
            return self._put_delivery(conn, delivery)

    def renew_delivery(self, job_id: str, owner: str, lease_s: float, attempts: int | None = None,
                       body: str | None = None) -> DeliveryRecord | None:
        with self._outbox() as conn:
            delivery = renewed(self._get_delivery(conn, job_id), owner, self._clock() + lease_s, attempts, body)
            return None if delivery is None else self._put_delivery(conn, delivery)

    def end_delivery(self, job_id: str, owner: str | None = None) -> bool:
        with self._outbox() as conn:
            delivery = self._get_delivery(conn, job_id)
            if delivery is None or (owner is not None and delivery.owner != owner):
                return False
            conn.execute("DELETE FROM deliveries WHERE job_id = ?", (job_id,))
            return True
