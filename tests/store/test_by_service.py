"""The store's answers by service, every backend (test_contract.py's fixture): a service lists, counts and claims
only its own jobs, in the store's query; the bound on unfinished jobs is part of the insert; a job claimed
max_attempts times ends failed in the claim; adapter registrations are one per (service, name), and deleted ones
are swept; the jobs of before services are adopted by their model's service. And a SQLite file of schema 1 is
brought to 2 with its records kept (their service is "", until adopted)."""

from __future__ import annotations

import json
import sqlite3

import pytest
from redis_server import redis_url  # noqa: F401  (a fixture)
from test_contract import backend, job  # noqa: F401  (the fixture)

from stepserve.store import FAILED, QUEUED, AdapterRecord
from stepserve.store.base import TOO_MANY_ATTEMPTS, TooManyUnfinished
from stepserve.store.sqlite import SqliteStore


def test_a_service_lists_counts_and_claims_only_its_own_jobs(backend):  # noqa: F811
    s = backend.store
    s.create_job(job(s, "x-old", at=0, service="x"))
    s.create_job(job(s, "y-1", at=1, service="y"))
    s.create_job(job(s, "y-img", "image", at=2, service="y"))
    s.create_job(job(s, "x-new", at=3, service="x"))
    assert [j.id for j in s.list_jobs(service="y")] == ["y-img", "y-1"]
    assert [j.id for j in s.list_jobs("video", service="x")] == ["x-new", "x-old"]
    assert [j.id for j in s.list_jobs(service="z")] == []
    assert (s.count_unfinished("x"), s.count_unfinished("y"), s.count_unfinished("y", "video")) == (2, 2, 1)
    first = s.claim_job("Y", lease_s=600, service="y", kinds=("video", "image"))
    assert first.id == "y-1" and s.claim_job("Y", lease_s=600, service="y").id == "y-img"
    assert s.claim_job("Y", lease_s=600, service="y") is None  # x's jobs are not y's, however old
    assert s.claim_job("Y", lease_s=600, service="y", job_id="x-old") is None
    assert s.get_job("x-old").owner is None and s.get_job("x-old").attempts == 0  # never touched
    assert s.claim_job("X", lease_s=600, service="x").id == "x-old"
    s.update_job("x-old", owner="X", status="completed", completed_at=s.now())
    assert s.count_unfinished("x") == 1


def test_the_bound_on_unfinished_jobs_is_part_of_the_insert(backend):  # noqa: F811
    s = backend.store
    s.create_job(job(s, "a", service="x"), max_unfinished=2)
    s.create_job(job(s, "b", service="x", idempotency_key="k"), max_unfinished=2)
    with pytest.raises(TooManyUnfinished) as refused:
        s.create_job(job(s, "c", service="x", idempotency_key="k2"), max_unfinished=2)
    assert refused.value.unfinished == 2 and s.get_job("c") is None
    # the same key gives the job made earlier, full or not; another service or kind has its own bound
    assert s.create_job(job(s, "d", service="x", idempotency_key="k"), max_unfinished=2)[0].id == "b"
    assert s.create_job(job(s, "e", service="y"), max_unfinished=2)[1]
    assert s.create_job(job(s, "f", "image", service="x"), max_unfinished=2)[1]
    s.update_job("a", status="completed", completed_at=s.now())
    assert s.create_job(job(s, "c", service="x"), max_unfinished=2)[1]


def test_a_job_claimed_max_attempts_times_ends_failed_and_the_next_is_taken(backend):  # noqa: F811
    s = backend.store
    s.create_job(job(s, "crashes", at=0, service="x"))
    s.create_job(job(s, "next", at=1, service="x"))
    for attempt in (1, 2, 3):  # each time, its process dies: the lease passes and it is claimed again
        got = s.claim_job(f"P{attempt}", lease_s=0.05, service="x", max_attempts=3)
        assert (got.id, got.attempts) == ("crashes", attempt)
        backend.pass_time(got.lease_until)
    ended = []
    got = s.claim_job("P4", lease_s=600, service="x", max_attempts=3, ended=ended)
    assert got.id == "next" and got.status == QUEUED
    assert [(j.id, j.status, j.error["code"]) for j in ended] == [("crashes", FAILED, TOO_MANY_ATTEMPTS)]
    failed = s.get_job("crashes")
    assert (failed.status, failed.owner, failed.error["code"]) == (FAILED, None, TOO_MANY_ATTEMPTS)
    assert "3 times" in failed.error["message"] and failed.completed_at is not None and failed.attempts == 3
    assert s.count_unfinished("x") == 1 and [j.id for j in s.sweep(s.now() + 1)] == ["crashes"]


def test_the_jobs_of_before_services_are_adopted_by_their_models_service(backend):  # noqa: F811
    s = backend.store
    s.create_job(job(s, "old-a", at=0, meta={"model": "a"}))  # service "": written before services
    s.create_job(job(s, "old-a-done", at=1, meta={"model": "a"}, status="completed", completed_at=s.now()))
    s.create_job(job(s, "old-b", at=2, meta={"model": "b"}))
    s.create_job(job(s, "new-a", at=3, meta={"model": "a"}, service="other"))
    assert s.claim_job("A", 600, service="a-1") is None
    assert s.adopt_jobs("a", "a-1") == 2 and s.adopt_jobs("a", "a-2") == 0  # the first server of the model takes them
    assert [j.id for j in s.list_jobs(service="a-1")] == ["old-a-done", "old-a"]
    assert s.count_unfinished("a-1") == 1 and s.get_job("old-a").service == "a-1"
    assert s.claim_job("A", 600, service="a-1").id == "old-a"
    assert s.get_job("old-b").service == "" and s.get_job("new-a").service == "other"


def test_a_clean_hand_back_gives_its_attempt_back_and_a_counted_one_keeps_it(backend):  # noqa: F811
    s = backend.store
    s.create_job(job(s, "j", service="x"))
    for _ in range(5):  # drains, a full engine: never the job's fault
        assert s.claim_job("A", 600, service="x", max_attempts=3).attempts == 1
        assert s.release_job("j", "A").attempts == 0
    assert s.release_job("j", "A") is None  # nobody's now: only the owner hands it back
    assert s.claim_job("A", 600, service="x", max_attempts=3).attempts == 1
    released = s.release_job("j", "A", counted=True)  # a restarted owner's orphan: its process died on it
    assert (released.attempts, released.owner, released.status) == (1, None, QUEUED)
    assert s.claim_job("B", 600, service="x", max_attempts=3).attempts == 2


def test_adapter_registrations_are_one_per_service_and_name_and_deleted_ones_are_swept(backend):  # noqa: F811
    s = backend.store
    s.register_adapter(AdapterRecord("style", "x/style.safetensors", 1.0, service="x"))
    s.register_adapter(AdapterRecord("style", "y/style.safetensors", 2.0, service="y"))
    assert [(r.service, r.path) for r in s.adapters()] == [("x", "x/style.safetensors"), ("y", "y/style.safetensors")]
    assert [r.path for r in s.adapters("y")] == ["y/style.safetensors"]
    assert s.delete_adapter("style", "z") is None
    deleted = s.delete_adapter("style", "y")
    assert deleted.deleted_at is not None and deleted.service == "y"
    assert [r.deleted_at for r in s.adapters("x")] == [None]  # x's registration is untouched
    assert s.sweep_adapters(deleted.deleted_at) == 0  # deleted at, not before
    backend.pass_time(deleted.deleted_at)
    assert s.sweep_adapters(s.now()) == 1
    assert [r.service for r in s.adapters()] == ["x"]


def test_a_schema_1_file_is_brought_to_2_and_keeps_its_records(tmp_path):
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as conn:  # a file as the release before services wrote it
        from stepserve.store.sqlite import TABLES

        for statement in TABLES:
            conn.execute(statement)
        doc = {"id": "old", "kind": "video", "request": {}, "created_at": 1.0, "status": "queued",
               "meta": {"model": "tiny"}}
        conn.execute("INSERT INTO jobs (id, kind, status, owner, lease_until, created_at, doc) VALUES "
                     "('old', 'video', 'queued', NULL, 0.0, 1.0, ?)", (json.dumps(doc),))
        conn.execute("INSERT INTO adapters VALUES ('style', NULL, ?)",
                     (json.dumps({"name": "style", "path": "s.safetensors", "registered_at": 1.0}),))
        conn.execute("PRAGMA user_version = 1")
    store = SqliteStore(path)
    assert store.get_job("old").service == "" and [j.id for j in store.list_jobs(service="")] == ["old"]
    assert store.count_unfinished("") == 1 and store.claim_job("A", 60, service="other") is None
    assert [(r.name, r.service) for r in store.adapters("")] == [("style", "")]
    assert store.adopt_jobs("tiny", "tiny-1") == 1 and store.claim_job("A", 60, service="tiny-1").id == "old"
    assert store.get_job("old").service == "tiny-1" and store.count_unfinished("") == 0
    store.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2
