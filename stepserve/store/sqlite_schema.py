"""The SQLite store's schema (sqlite.py): its tables and indexes, the steps from one schema version to the next,
and the claim's query (which the indexes are made for)."""

from __future__ import annotations

from .base import FINISHED

SCHEMA = 2  # PRAGMA user_version of the files this release writes

TABLES = (
    """CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        status TEXT NOT NULL,
        owner TEXT,
        lease_until REAL NOT NULL,
        created_at REAL NOT NULL,
        completed_at REAL,
        idempotency_key TEXT UNIQUE,
        doc TEXT NOT NULL)""",
    "CREATE INDEX jobs_by_created ON jobs (created_at)",
    "CREATE INDEX jobs_by_kind ON jobs (kind, created_at)",
    "CREATE INDEX jobs_by_owner ON jobs (owner, lease_until)",
    "CREATE INDEX jobs_by_completed ON jobs (completed_at)",
    # what claim_job reads: the unfinished jobs of a kind (finished ones, kept until swept, are not in it)
    "CREATE INDEX jobs_open ON jobs (kind, created_at) WHERE status NOT IN ('completed', 'failed')",
    "CREATE TABLE adapters (name TEXT PRIMARY KEY, deleted_at REAL, doc TEXT NOT NULL)",
    "CREATE TABLE replicas (replica TEXT PRIMARY KEY, expires_at REAL NOT NULL, info TEXT NOT NULL)",
)
# Schema 2: jobs and adapter registrations belong to a service. A job's service is a column (what the claim, the
# count and the listing of a service read, through these indexes); registrations are keyed by (service, name).
# Records of a schema-1 file keep the service "" (see docs/SCALING.md, "Services").
TO_2 = (
    "ALTER TABLE jobs ADD COLUMN service TEXT NOT NULL DEFAULT ''",
    "CREATE INDEX jobs_by_service ON jobs (service, kind, created_at)",
    "CREATE INDEX jobs_open_by_service ON jobs (service, kind, created_at) WHERE status NOT IN ('completed', "
    "'failed')",
    "ALTER TABLE adapters RENAME TO adapters_1",
    "CREATE TABLE adapters (service TEXT NOT NULL, name TEXT NOT NULL, deleted_at REAL, doc TEXT NOT NULL, "
    "PRIMARY KEY (service, name))",
    "INSERT INTO adapters (service, name, deleted_at, doc) SELECT '', name, deleted_at, doc FROM adapters_1",
    "DROP TABLE adapters_1",
)
UNFINISHED = "status NOT IN ('completed', 'failed')"
assert FINISHED == ("completed", "failed")  # the SQL above spells them out


def claim_query(kinds: int, by_id: bool, by_service: bool) -> str:
    """The oldest claimable job (of `kinds` kinds; the one id given first when by_id; the service given next when
    by_service); then the clock's now."""
    which = ("id = ? AND " if by_id else "") + ("service = ? AND " if by_service else "")
    return (f"SELECT doc FROM jobs WHERE {which}{UNFINISHED} AND kind IN ({', '.join('?' * kinds)}) "
            "AND (owner IS NULL OR lease_until < ?) ORDER BY created_at, rowid LIMIT 1")
