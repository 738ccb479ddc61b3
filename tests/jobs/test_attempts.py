"""A job's attempts, on async image jobs of the embedded model: a job whose process died on it max_attempts times
ends failed and the next runs; results are named per attempt, so an owner that stalled past its lease cannot take
the file of the owner that finished the job; a store that fails at the end is asked again, not taken for a failed
job; an internal error shows a code and a short message (the details go to the log); a dead engine claims nothing;
a job is refused with a 503 where a synchronous request would be (draining, a dead engine)."""

from __future__ import annotations

import logging

import pytest
from job_helpers import CountingStore, app_client, wait_job
from server.server_helpers import wait_until
from step_gate import SteppedExecutor

from stepserve.engine.loading import load_executor
from stepserve.jobs.attempt import INTERNAL
from stepserve.jobs.service import new_id
from stepserve.store import JobRecord
from stepserve.store.memory import MemoryStore
from stepserve.store.results import Results

GENERATIONS, JOBS = "/v1/images/generations", "/v1/images/jobs"
ASYNC = {"Prefer": "respond-async"}
BODY = {"prompt": "one", "seed": 3, "num_inference_steps": 3}


@pytest.fixture(scope="module")
def embedded():
    return load_executor("embedded")


class Partitioned:
    """A store (wrapping another) cut off from this process for every write but a job's end while `cut` is set:
    its progress and renewals fail (the runner carries on computing), and the partition heals for the end."""

    def __init__(self, store) -> None:
        self._store, self.url, self.cut = store, store.url, False

    def __getattr__(self, name):
        return getattr(self._store, name)

    def update_job(self, job_id, owner=None, **changes):
        if self.cut and changes.get("status") not in ("completed", "failed"):
            raise ConnectionError("the state store is unreachable")
        return self._store.update_job(job_id, owner, **changes)


def test_a_job_whose_process_died_on_it_three_times_ends_failed_and_the_next_runs(embedded):
    store = MemoryStore()
    with app_client(embedded, store=store, owner="a") as c:
        jobs = c.app.state.server.jobs
        told = []
        kind = jobs.kinds["image"]
        ended = kind.ended
        kind.ended = lambda job, outcome, results: told.append((job.id, outcome)) or ended(job, outcome, results)
        jobs.runner.claiming = False
        crashing = c.post(GENERATIONS, json=BODY, headers=ASYNC).json()
        after = c.post(GENERATIONS, json={**BODY, "seed": 4}, headers=ASYNC).json()
        for attempt in range(3):  # three processes took it and died on it (host out of memory, a native crash)
            assert store.claim_job(f"dead-{attempt}", 30.0, job_id=crashing["id"], service=jobs.service)
            store.update_job(crashing["id"], lease_until=0.0)  # each one's lease passed
        jobs.runner.claiming = True
        jobs.runner.wake()
        done = wait_job(c, f"{JOBS}/{after['id']}")
        failed = c.get(f"{JOBS}/{crashing['id']}").json()
    assert done["status"] == "completed", done
    assert failed["status"] == "failed" and failed["error"]["code"] == "too_many_attempts", failed
    assert "3 times" in failed["error"]["message"] and store.get_job(crashing["id"]).attempts == 3
    assert (crashing["id"], "failed") in told and (after["id"], "completed") in told  # each end told once
    assert len(told) == 2


def test_an_owner_stalled_past_its_lease_leaves_the_file_of_the_owner_that_finished(embedded, tmp_path):
    shared, results = MemoryStore(), Results(tmp_path, keep_s=3600)
    partitioned, gate = Partitioned(shared), SteppedExecutor(embedded)
    with app_client(gate, store=partitioned, results=results, owner="a", service="s") as a, \
            app_client(load_executor("embedded"), store=shared, results=results, owner="b", service="s") as b:
        runner_a, runner_b = a.app.state.server.jobs.runner, b.app.state.server.jobs.runner
        runner_b.claiming = False
        try:
            job = a.post(GENERATIONS, json=BODY, headers=ASYNC).json()
            assert gate.wait_held(), "the job never reached its first step"
            runner_a.claiming = False
            partitioned.cut = True  # a stalls: its progress and renewals no longer reach the store...
            shared.update_job(job["id"], lease_until=0.0)  # ...and its lease passes
            runner_b.claiming = True
            runner_b.wake()
            done = wait_job(b, f"{JOBS}/{job['id']}")
        finally:
            gate.free()  # a resumes: it computes to the end, writes its file, and its fenced end finds b's
        assert wait_until(lambda: not runner_a.running, 240), "a never stopped"
        after = b.get(f"{JOBS}/{job['id']}").json()
    assert done["status"] == "completed" and done["result"] is not None, done
    assert after["status"] == "completed" and after["result"] == done["result"]  # still downloadable
    assert shared.get_job(job["id"]).results == [f"{job['id']}.2.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{job['id']}.2.json"]  # a's own file went


def test_a_store_error_at_the_end_is_retried_and_the_job_completes(embedded):
    class FailsOnce(CountingStore):
        failed = False

        def update_job(self, job_id, owner=None, **changes):
            if changes.get("status") == "completed" and not self.failed:
                self.failed = True
                raise ConnectionError("Redis at 10.0.0.5:6379: connection reset")
            return self._store.update_job(job_id, owner, **changes)

    store = FailsOnce(MemoryStore())
    with app_client(embedded, store=store) as c:
        job = c.post(GENERATIONS, json=BODY, headers=ASYNC).json()
        done = wait_job(c, f"{JOBS}/{job['id']}")
    assert store.failed and done["status"] == "completed" and done["result"] is not None, done


def test_an_internal_error_shows_a_code_and_a_short_message_and_logs_the_rest(embedded, caplog):
    with app_client(embedded) as c:
        async def broken(job, results):
            raise OSError("cannot write /srv/secret/results at 10.0.0.5:6379")

        c.app.state.server.jobs.kinds["image"].finish = broken
        job = c.post(GENERATIONS, json=BODY, headers=ASYNC).json()
        with caplog.at_level(logging.ERROR, "stepserve.jobs"):
            failed = wait_job(c, f"{JOBS}/{job['id']}")
    assert failed["status"] == "failed" and failed["error"] == {"code": "internal_error", "message": INTERNAL}
    assert "/srv/secret" in caplog.text  # for the operator


def test_a_model_failure_shows_a_code_and_a_short_message_and_logs_the_rest(embedded, caplog):
    from stepserve.server.job_http import MODEL_FAILURE

    class FailingDecode:
        def __init__(self, executor) -> None:
            self._executor = executor

        def __getattr__(self, name):
            return getattr(self._executor, name)

        def decode(self, requests):
            raise OSError("cannot read /srv/secret/vae.safetensors")

    with app_client(FailingDecode(embedded)) as c:
        job = c.post(GENERATIONS, json=BODY, headers=ASYNC).json()
        with caplog.at_level(logging.WARNING):
            failed = wait_job(c, f"{JOBS}/{job['id']}")
    assert failed["status"] == "failed" and failed["error"] == {"code": "model_failure", "message": MODEL_FAILURE}
    assert "/srv/secret" in caplog.text  # for the operator


def test_a_dead_engine_claims_nothing_and_refuses_new_jobs(embedded):
    store = CountingStore(MemoryStore())
    with app_client(embedded, store=store) as c:
        state = c.app.state.server
        runner = state.jobs.runner

        def rounds_pass(n: int) -> None:  # n whole rounds of the runner's loop (each wakes it and ends)
            for _ in range(n):
                seen = runner.rounds
                runner.wake()
                assert wait_until(lambda: runner.rounds > seen + 1, 60)

        state.engine.failure = "injected fault"  # the engine thread died
        rounds_pass(1)  # a round that began before it is over
        claims = store.calls.count("claim_job")
        store.create_job(JobRecord(new_id("imgjob"), "image", {"route": "generations", "body": BODY, "inputs": {}},
                                   store.now(), service=state.jobs.service))
        rounds_pass(3)
        refused = c.post(GENERATIONS, json=BODY, headers=ASYNC)
    assert store.calls.count("claim_job") == claims
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed", refused.text
    assert len(store.list_jobs()) == 1  # no job was made for the refused request


def test_a_job_handed_back_is_not_claimed_again_at_once(embedded, tmp_path):
    """An engine that stops taking work (shutting down) hands the claimed job back: the runner then backs off,
    rather than claim the same job again on every wake (a claim, a write transaction, each time)."""
    from stepserve.store.sqlite import SqliteStore

    store = CountingStore(SqliteStore(tmp_path / "state.db"))  # durable: a job is handed back, not failed
    with app_client(embedded, store=store) as c:
        state = c.app.state.server
        runner = state.jobs.runner
        runner.backoff_s = 3600.0
        state.engine.accepting = False  # healthy, but every submission is refused (ShuttingDownError)
        job, _ = store.create_job(JobRecord(new_id("imgjob"), "image", {"route": "generations", "body": BODY,
                                                                        "inputs": {}}, store.now(),
                                            service=state.jobs.service))
        assert wait_until(lambda: "release_job" in store.calls, 60)  # claimed, refused, handed back
        for _ in range(4):
            seen = runner.rounds
            runner.wake()
            assert wait_until(lambda: runner.rounds > seen + 1, 60)
        state.engine.accepting = True
        held = store.get_job(job.id)
    assert store.calls.count("release_job") == 1 and held.owner is None
    assert held.attempts == 0  # a clean hand-back: its claim does not count toward --job-max-attempts


def test_a_draining_server_refuses_new_jobs_with_a_503(embedded, tmp_path):
    results = Results(tmp_path, keep_s=3600)
    with app_client(embedded, results=results) as c:
        c.app.state.server.draining = True
        refused = c.post(GENERATIONS, json=BODY, headers=ASYNC)
        listed = c.get(JOBS).json()["data"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
    assert listed == [] and list(tmp_path.iterdir()) == []


def test_a_held_add_on_memory_hands_the_job_back_to_run_again(embedded):
    """An add-on memory held by requests in flight is a 'retry later' (429 to a synchronous request): the job is
    handed back and runs again, not failed for good."""
    from stepserve.controls.errors import ControlNetBudgetError

    class HeldOnce:
        def __init__(self, executor) -> None:
            self._executor, self.prepared = executor, 0

        def __getattr__(self, name):
            return getattr(self._executor, name)

        def prepare(self, requests):
            self.prepared += 1
            if self.prepared == 1:
                raise ControlNetBudgetError("the ControlNet memory is held by requests in flight; retry later")
            return self._executor.prepare(requests)

    executor = HeldOnce(embedded)
    with app_client(executor) as c:
        c.app.state.server.jobs.runner.backoff_s = 0.05
        job = c.post(GENERATIONS, json=BODY, headers=ASYNC).json()
        done = wait_job(c, f"{JOBS}/{job['id']}")
    assert done["status"] == "completed", done
    assert executor.prepared >= 2


def test_an_end_written_whose_answer_was_lost_keeps_its_files(embedded, tmp_path):
    """The final write went through but its answer never came (a connection reset after the commit), and no write
    goes through after it until the lease passes: the job is completed in the store, so its files stay."""
    class AnswerLost(CountingStore):
        cut = False

        def update_job(self, job_id, owner=None, **changes):
            if self.cut:
                raise ConnectionError("the state store is unreachable")
            record = self._store.update_job(job_id, owner, **changes)
            if changes.get("status") == "completed":
                self.cut = True
                raise ConnectionError("connection reset after the write")
            return record

    store, results = AnswerLost(MemoryStore()), Results(tmp_path, keep_s=3600)
    # a short lease (the end is given up once it would pass), long enough that a stall on a busy machine does
    # not let it lapse mid-run
    with app_client(embedded, store=store, results=results, lease_s=5.0, poll_s=0.05) as c:
        runner = c.app.state.server.jobs.runner
        job = c.post(GENERATIONS, json=BODY, headers=ASYNC).json()
        assert wait_until(lambda: store._store.get_job(job["id"]).status == "completed", 240)
        assert wait_until(lambda: not runner.running, 240), "the runner never gave the end up"
        record = store._store.get_job(job["id"])
    assert record.results and all((tmp_path / name).is_file() for name in record.results)


def test_a_job_meeting_a_held_add_on_memory_again_and_again_ends(embedded):
    """Hand-backs for a held add-on memory count as attempts: a job whose images keep meeting one (here beside an
    image that fails for good) ends failed within --job-max-attempts, never handed back forever. (The job stops at
    its first failed image, so which of the two it meets first decides its code.)"""
    from stepserve.controls.errors import ControlNetBudgetError

    class Mixed:
        def __init__(self, executor) -> None:
            self._executor = executor

        def __getattr__(self, name):
            return getattr(self._executor, name)

        def prepare(self, requests):
            if any(r.params.seed == 3 for r in requests):
                raise ControlNetBudgetError("the ControlNet memory is held by requests in flight; retry later")
            if any(r.params.seed == 4 for r in requests):
                raise OSError("cannot read /srv/secret/controlnet")
            return self._executor.prepare(requests)

    with app_client(Mixed(embedded)) as c:
        c.app.state.server.jobs.runner.backoff_s = 0.05
        job = c.post(GENERATIONS, json={**BODY, "n": 2}, headers=ASYNC).json()  # seeds 3 and 4
        failed = wait_job(c, f"{JOBS}/{job['id']}")
    assert failed["status"] == "failed", failed
    assert failed["error"]["code"] in ("model_failure", "too_many_attempts"), failed
