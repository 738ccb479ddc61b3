"""The store backends the contract tests run against, opened by (name, location, prefix) so that a child process
opens the same state; and the work of one claiming process (run with multiprocessing's spawn)."""

from __future__ import annotations

import time
import traceback

from stepserve.store import JobRecord


class Clock:
    """A store clock the test moves (memory and SQLite take one; Redis reads its own TIME)."""

    def __init__(self, t: float = 1_800_000_000.25) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def open_backend(name: str, location: str = "", prefix: str = "", clock=None):
    if name == "memory":
        from stepserve.store.memory import MemoryStore

        return MemoryStore(clock or time.time)
    if name == "sqlite":
        from stepserve.store.sqlite import SqliteStore

        return SqliteStore(location, clock=clock or time.time)
    from stepserve.store.redis import RedisStore

    return RedisStore(location, prefix=prefix)


def claim_until_none(name: str, location: str, prefix: str, worker: int, barrier, results) -> None:
    """Every process creates a job under one shared idempotency key, then claims video jobs until none is left,
    completing each (fenced by its owner). Puts (worker, created?, claimed ids, error or None) on `results`."""
    created, claimed, error = False, [], None
    try:
        store = open_backend(name, location, prefix)
        barrier.wait(timeout=120)
        job = JobRecord(id=f"same-key-{worker}", kind="image", request={}, created_at=store.now(),
                        idempotency_key="the same key")
        created = store.create_job(job)[1]
        while (job := store.claim_job(f"worker-{worker}", lease_s=600, kinds=("video",))) is not None:
            claimed.append(job.id)
            done = store.update_job(job.id, owner=f"worker-{worker}", status="completed", progress=100,
                                    completed_at=store.now())
            if done is None:
                raise AssertionError(f"worker {worker} lost {job.id} that it had just claimed")
        store.close()
    except BaseException:  # noqa: BLE001  (the parent reports it)
        error = traceback.format_exc()
    results.put((worker, created, claimed, error))
