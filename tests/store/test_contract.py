"""One contract (stepserve/store/base.py), every backend: memory (the reference), SQLite (a file in a temporary
folder) and Redis (a real redis-server, tests/store/redis_server.py). Memory and SQLite run on a clock the test
moves; Redis keeps its own (TIME), so its leases and publications are given short lives and the test waits until
the store's own clock has passed them."""

from __future__ import annotations

import itertools
import multiprocessing
import time
from dataclasses import dataclass

import pytest
from redis_server import redis_url  # noqa: F401  (a fixture)
from store_backends import Clock, claim_until_none, open_backend

from stepserve.store import COMPLETED, FAILED, IN_PROGRESS, QUEUED, AdapterRecord, JobRecord

BACKENDS = ("memory", "sqlite", "redis")
_prefixes = itertools.count()


@dataclass
class Backend:
    name: str
    store: object
    location: str
    prefix: str
    clock: Clock | None  # None: the store's own clock (Redis)

    def pass_time(self, until: float) -> None:
        """Until the store's clock reads later than `until`: moved (a test clock) or waited for (Redis's)."""
        if self.clock is not None:
            self.clock.t = max(self.clock.t, until + 0.001)
            return
        deadline = time.monotonic() + 60  # a hang bound only: the wait ends when the store's clock passes
        while self.store.now() <= until:
            assert time.monotonic() < deadline, "the store's clock did not move"
            time.sleep(0.02)


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    name, location, prefix, clock = request.param, "", "", None
    if name == "sqlite":
        location, clock = str(tmp_path / "state" / "state.db"), Clock()
    elif name == "memory":
        clock = Clock()
    else:
        location, prefix = request.getfixturevalue("redis_url"), f"test{next(_prefixes)}:"
    store = open_backend(name, location, prefix, clock)
    yield Backend(name, store, location, prefix, clock)
    store.close()


def job(store, id: str, kind: str = "video", at: float = 0.0, **fields) -> JobRecord:
    fields = {"request": {"prompt": id, "seed": 7}, "created_at": store.now() + at, **fields}
    return JobRecord(id=id, kind=kind, **fields)


def test_a_job_comes_back_as_it_was_written(backend):
    s = backend.store
    j = job(s, "j1", request={"prompt": "à l'été ✓", "nested": {"a": [1, 2.5, None, True]}, "guidance": 0.1},
            meta={"model": "tiny", "request_id": "r-1"}, webhook={"url": "http://x", "state": "pending"},
            created_at=1_800_000_000.123456)
    stored, created = s.create_job(j)
    assert created and stored == j
    assert s.get_job("j1") == j and s.get_job("j1").created_at == 1_800_000_000.123456  # every digit kept
    assert s.get_job("nope") is None
    with pytest.raises(ValueError, match="exists already"):
        s.create_job(job(s, "j1"))


def test_an_idempotency_key_returns_the_first_job_until_it_is_deleted(backend):
    s = backend.store
    first, created = s.create_job(job(s, "a", idempotency_key="key-1"))
    again, created_again = s.create_job(job(s, "b", idempotency_key="key-1"))
    assert created and not created_again and again == first
    assert s.get_job("b") is None  # nothing was written
    assert s.create_job(job(s, "c", idempotency_key="key-2"))[1] and s.create_job(job(s, "d"))[1]
    s.delete_job("a")
    assert s.create_job(job(s, "e", idempotency_key="key-1")) == (s.get_job("e"), True)


def test_list_is_newest_first_by_kind_and_limited(backend):
    s = backend.store
    for i, kind in enumerate(["video", "image", "video", "image", "video"]):
        s.create_job(job(s, f"j{i}", kind, at=i))
    assert [j.id for j in s.list_jobs()] == ["j4", "j3", "j2", "j1", "j0"]
    assert [j.id for j in s.list_jobs("video")] == ["j4", "j2", "j0"]
    assert [j.id for j in s.list_jobs("image", limit=1)] == ["j3"]
    assert s.list_jobs(limit=0) == []


def test_only_the_owner_updates_a_job_it_holds(backend):
    s = backend.store
    s.create_job(job(s, "j"))
    assert s.claim_job("A", lease_s=600).owner == "A"
    assert s.update_job("j", owner="B", progress=50) is None  # a process that lost the job is fenced out
    assert s.get_job("j").progress == 0
    updated = s.update_job("j", owner="A", progress=40, status=IN_PROGRESS, meta={"step": 4})
    assert (updated.progress, updated.status, updated.meta) == (40, IN_PROGRESS, {"step": 4})
    assert s.get_job("j") == updated
    assert s.update_job("j", progress=60).progress == 60  # no owner given: no fence
    assert s.update_job("missing", progress=1) is None and s.update_job("missing", owner="A") is None
    for bad in ({"finished": True}, {"id": "x"}, {"idempotency_key": "k"}, {"progress": 70, "colour": "red"}):
        with pytest.raises(ValueError, match="no field"):
            s.update_job("j", owner="A", **bad)
    assert s.get_job("j").progress == 60  # nothing of a refused update was applied


def test_claims_take_the_oldest_free_job_of_the_kinds_asked(backend):
    s = backend.store
    s.create_job(job(s, "new", at=3))
    s.create_job(job(s, "image", "image", at=1))
    s.create_job(job(s, "old", at=2))
    s.create_job(job(s, "done", at=0, status=COMPLETED, completed_at=s.now()))
    s.create_job(job(s, "failed", at=0, status=FAILED, completed_at=s.now()))
    before = s.now()
    first = s.claim_job("A", lease_s=30, kinds=("video",))
    assert first.id == "old" and (first.owner, first.attempts, first.status, first.progress) == ("A", 1, QUEUED, 0)
    assert before + 30 <= first.lease_until <= s.now() + 30 and s.get_job("old") == first
    assert s.claim_job("A", lease_s=30, kinds=("video",)).id == "new"
    assert s.claim_job("A", lease_s=30, kinds=("video",)) is None  # finished jobs are never claimed
    assert s.claim_job("B", lease_s=30, job_id="image").id == "image"
    assert s.claim_job("B", lease_s=30, job_id="missing") is None
    assert s.claim_job("B", lease_s=30, job_id="done") is None


def test_a_job_whose_lease_passed_is_taken_over_and_starts_again(backend):
    s = backend.store
    s.create_job(job(s, "j"))
    s.claim_job("A", lease_s=600)
    assert s.claim_job("B", lease_s=600) is None and s.claim_job("B", 600, job_id="j") is None
    running = s.update_job("j", owner="A", status=IN_PROGRESS, progress=70, lease_until=s.now() + 0.3)  # renewed
    backend.pass_time(running.lease_until)
    taken = s.claim_job("B", lease_s=600)
    assert (taken.id, taken.owner, taken.attempts, taken.status, taken.progress) == ("j", "B", 2, QUEUED, 0)
    assert s.update_job("j", owner="A", progress=80) is None  # the old owner finds out and stops
    assert s.get_job("j").owner == "B"


def test_a_released_job_is_claimable_at_once(backend):
    s = backend.store
    s.create_job(job(s, "j"))
    s.claim_job("A", lease_s=600)
    s.update_job("j", owner="A", status=IN_PROGRESS, progress=30)
    assert s.release_job("j", "B") is None
    released = s.release_job("j", "A")
    assert (released.owner, released.status, released.progress, released.lease_until) == (None, QUEUED, 0, 0.0)
    assert s.claim_job("B", lease_s=600).owner == "B"


def test_a_deleted_job_is_gone_and_its_owner_is_told(backend):
    s = backend.store
    s.create_job(job(s, "j", idempotency_key="k"))
    s.create_job(job(s, "other", at=1))
    held = s.claim_job("A", lease_s=600, job_id="j")
    assert s.delete_job("j") == held
    assert s.get_job("j") is None and s.delete_job("j") is None
    assert s.update_job("j", owner="A", progress=10) is None and s.update_job("j", progress=10) is None
    assert [j.id for j in s.list_jobs()] == ["other"] and [j.id for j in s.list_jobs("video")] == ["other"]
    assert s.claim_job("B", lease_s=600).id == "other"
    assert s.create_job(job(s, "again", idempotency_key="k"))[1]


def test_sweep_deletes_the_jobs_finished_before_a_time(backend):
    s = backend.store
    t = s.now()
    s.create_job(job(s, "completed", status=COMPLETED, completed_at=t - 100, idempotency_key="k"))
    s.create_job(job(s, "failed", status=FAILED, completed_at=t - 50))
    s.create_job(job(s, "recent", status=COMPLETED, completed_at=t - 10))
    s.create_job(job(s, "running", status=IN_PROGRESS))
    s.create_job(job(s, "queued"))
    s.create_job(job(s, "finishing", at=1))
    s.update_job("finishing", status=COMPLETED, completed_at=t - 20)  # finished by an update
    swept = s.sweep(finished_before=t - 10)
    assert sorted(j.id for j in swept) == ["completed", "failed", "finishing"]
    assert sorted(j.id for j in s.list_jobs()) == ["queued", "recent", "running"]
    assert s.sweep(finished_before=t - 10) == []
    assert s.create_job(job(s, "new", idempotency_key="k"))[1]  # the swept job's key went with it


def test_adapters_are_registered_marked_deleted_and_registered_again(backend):
    s = backend.store
    s.register_adapter(AdapterRecord(name="style.v2", path="styles/v2", registered_at=s.now()))
    s.register_adapter(AdapterRecord(name="anime", path="anime", registered_at=s.now()))
    assert [a.name for a in s.adapters()] == ["anime", "style.v2"]
    before = s.now()
    deleted = s.delete_adapter("anime")
    assert deleted.name == "anime" and before <= deleted.deleted_at <= s.now()
    assert s.delete_adapter("anime") is None and s.delete_adapter("unknown") is None
    assert s.adapters()[0] == deleted and s.adapters()[1].deleted_at is None
    s.register_adapter(AdapterRecord(name="anime", path="anime-2", registered_at=s.now()))
    assert (s.adapters()[0].path, s.adapters()[0].deleted_at) == ("anime-2", None)


def test_publications_last_their_ttl(backend):
    s = backend.store
    s.publish("replica-1", {"adapters": ["anime"], "jobs": 1}, ttl_s=600)
    s.publish("replica-2", {"adapters": [], "jobs": 0}, ttl_s=0.3)
    published = s.now()
    assert s.replicas() == {"replica-1": {"adapters": ["anime"], "jobs": 1}, "replica-2": {"adapters": [], "jobs": 0}}
    backend.pass_time(published + 0.3)
    assert s.replicas() == {"replica-1": {"adapters": ["anime"], "jobs": 1}}
    s.publish("replica-2", {"jobs": 2}, ttl_s=600)
    assert s.replicas()["replica-2"] == {"jobs": 2}


@pytest.mark.parametrize("backend", ["sqlite", "redis"], indirect=True)
def test_processes_claiming_at_once_claim_every_job_exactly_once(backend):
    s, workers = backend.store, 3
    ids = [f"job-{i:03}" for i in range(90)]
    for i, job_id in enumerate(ids):
        s.create_job(job(s, job_id, at=i * 1e-3))
    spawn = multiprocessing.get_context("spawn")
    barrier, results = spawn.Barrier(workers), spawn.Queue()
    processes = [spawn.Process(target=claim_until_none, args=(backend.name, backend.location, backend.prefix, w,
                                                              barrier, results)) for w in range(workers)]
    for p in processes:
        p.start()
    answers = [results.get(timeout=240) for _ in processes]  # a hang bound only
    for p in processes:
        p.join(timeout=60)
    assert [error for *_, error in answers if error] == []
    claimed = [job_id for _, _, ids_, _ in answers for job_id in ids_]
    assert sorted(claimed) == ids  # none lost, none twice
    assert sum(created for _, created, _, _ in answers) == 1  # one job under the shared idempotency key
    assert len(s.list_jobs("image")) == 1
    assert all(j.attempts == 1 and j.status == COMPLETED for j in s.list_jobs("video", limit=1000))
