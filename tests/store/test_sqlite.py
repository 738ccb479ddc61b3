"""The SQLite store's own promises (the contract itself is tests/store/test_contract.py): a file in a new folder,
WAL mode, state kept across a restart, one store shared by threads, and clear errors for a file it cannot use."""

from __future__ import annotations

import sqlite3
import threading

import pytest

from stepserve.store import JobRecord, StoreError, default_url, open_store
from stepserve.store.sqlite import SCHEMA, SqliteStore, claim_query


def test_the_default_is_a_file_in_the_users_state_folder_made_on_first_use(tmp_path):
    url = default_url({"XDG_STATE_HOME": str(tmp_path / "xdg")})
    assert url == f"sqlite:///{tmp_path / 'xdg' / 'stepserve' / 'state.db'}"
    store = open_store(url)
    assert isinstance(store, SqliteStore) and store.url == url
    assert (tmp_path / "xdg" / "stepserve" / "state.db").is_file()
    store.close()
    with sqlite3.connect(tmp_path / "xdg" / "stepserve" / "state.db") as conn:  # WAL is a property of the file
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA


def test_jobs_survive_a_restart(tmp_path):
    store = SqliteStore(tmp_path / "state.db")
    store.create_job(JobRecord(id="j", kind="video", request={"seed": 3}, created_at=store.now(),
                               idempotency_key="k"))
    store.claim_job("before-restart", lease_s=600)
    store.close()
    again = SqliteStore(tmp_path / "state.db")
    assert again.get_job("j").owner == "before-restart"
    assert again.create_job(JobRecord(id="j2", kind="video", request={}, created_at=0.0, idempotency_key="k"))[1] \
        is False
    again.close()


def test_a_claim_reads_only_the_unfinished_jobs(tmp_path):
    """Finished jobs stay until swept (a day by default): a claim must not read, let alone sort, all of them."""
    store = SqliteStore(tmp_path / "state.db")
    with sqlite3.connect(tmp_path / "state.db") as conn:
        for kinds in (1, 2):
            plan = conn.execute(f"EXPLAIN QUERY PLAN {claim_query(kinds, False, False)}", ("video",) * kinds + (0.0,))
            assert "USING INDEX jobs_open" in " ".join(row[-1] for row in plan.fetchall())
            plan = conn.execute(f"EXPLAIN QUERY PLAN {claim_query(kinds, False, True)}",
                                ("svc",) + ("video",) * kinds + (0.0,))  # a service's claim: its own open jobs
            assert "USING INDEX jobs_open_by_service" in " ".join(row[-1] for row in plan.fetchall())
    store.close()


def test_threads_of_one_process_claim_every_job_exactly_once(tmp_path):
    store = SqliteStore(tmp_path / "state.db")
    ids = [f"job-{i:03}" for i in range(80)]
    for i, job_id in enumerate(ids):
        store.create_job(JobRecord(id=job_id, kind="video", request={}, created_at=float(i)))
    barrier, claimed, errors = threading.Barrier(4), [], []

    def claim(worker: int) -> None:
        try:
            barrier.wait(timeout=60)
            while (job := store.claim_job(f"thread-{worker}", lease_s=600)) is not None:
                claimed.append(job.id)
                assert store.update_job(job.id, owner=f"thread-{worker}", status="completed", completed_at=1.0)
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=claim, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and sorted(claimed) == ids
    store.close()


def test_a_file_of_a_newer_schema_is_refused_naming_it(tmp_path):
    path = tmp_path / "state.db"
    SqliteStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA + 1}")
    with pytest.raises(StoreError, match=f"{path} has state schema {SCHEMA + 1}, newer than this release reads"):
        SqliteStore(path)


def test_a_file_that_is_not_a_database_is_refused_naming_it(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("these are my notes, not a database " * 100)
    with pytest.raises(StoreError, match=f"{path} is not a stepserve state file"):
        open_store(f"sqlite:///{path}")
    assert path.read_text().startswith("these are my notes")  # left as it was


def test_a_folder_that_cannot_be_made_is_a_clear_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(StoreError, match="cannot create the folder .*a-file"):
        SqliteStore(tmp_path / "a-file" / "state.db")
    with pytest.raises(ValueError, match="the path is empty"):
        open_store("sqlite:///")


def test_a_file_it_cannot_write_is_named_with_the_reason_not_called_foreign(tmp_path):
    path = tmp_path / "state.db"
    SqliteStore(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another process holding the write lock past the busy timeout
    try:
        with pytest.raises(StoreError, match=f"cannot use {path}: database is locked"):
            SqliteStore(path, busy_timeout_s=0.05)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
