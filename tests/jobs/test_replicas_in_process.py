"""Two processes' worth of jobs on one store, in process: two apps (each its engine, routes and runner) share a
store and a results folder, as two replicas do. A DELETE through the one that does not run a job stops it where it
runs within two of its steps; a job whose owner died (stopped without a word to the store) is taken over once its
lease has passed, and completes; a full engine queue hands a job back for later; a job with a webhook is notified
once, with the payload the sender delivers; a durable store gets a draining process's unfinished jobs back."""

from __future__ import annotations

import threading
import uuid

import pytest
from extras import require
from store.redis_server import redis_url  # noqa: F401  (a fixture)
from job_helpers import CountingStore, RecordingSender, app_client, die, wait_job
from job_helpers import wan_folder, one_torch_thread  # noqa: F401  (fixtures)
from server.server_helpers import wait_until
from step_gate import SteppedExecutor

from stepserve.engine.loading import load_executor
from stepserve.store.memory import MemoryStore
from stepserve.store.results import Results

SLOW = {"prompt": "a", "num_frames": 5, "num_inference_steps": 200, "seed": 4}
QUICK = {"prompt": "b", "num_frames": 5, "num_inference_steps": 3, "seed": 5}


@pytest.fixture(scope="module")
def wan_executors(wan_folder, one_torch_thread):
    require("imageio_ffmpeg", "video")
    return load_executor(str(wan_folder)), load_executor(str(wan_folder))


def test_a_delete_through_another_process_stops_the_job_within_two_steps(wan_executors, tmp_path):
    store, results = MemoryStore(), Results(tmp_path, keep_s=3600)
    gate = SteppedExecutor(wan_executors[0])
    steps_with_it: list[int] = []
    with app_client(gate, store=store, results=results, owner="a") as a, \
            app_client(wan_executors[1], store=store, results=results, owner="b", poll_s=3600) as b:
        engine_a = a.app.state.server.engine
        runner_a = a.app.state.server.jobs.runner
        b.app.state.server.jobs.runner.claiming = False  # a runs the job (b's first round may come after the POST)
        try:
            job = a.post("/v1/videos", json=SLOW).json()
            assert gate.wait_held(), "the job never reached its first step"
            gate.allow(3)
            assert wait_until(lambda: gate.steps == 3 and gate.held, 240)  # three steps run, the fourth held
            assert wait_until(lambda: b.get(f"/v1/videos/{job['id']}").json()["progress"] > 0, 240)
            assert b.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress"  # any process answers
            request_id = store.get_job(job["id"]).meta["request_ids"][0]
            engine_a.on_step.append(lambda report: steps_with_it.append(
                sum(r.request_id == request_id for r in report.progressed)))
            told_abort = threading.Event()  # the owner's runner told its engine to abort the job's request
            abort = engine_a.abort

            def abort_told(rid, *args, **kwargs):
                if rid == request_id:
                    told_abort.set()
                return abort(rid, *args, **kwargs)

            engine_a.abort = abort_told
            deleted = b.delete(f"/v1/videos/{job['id']}")  # not the owner: it finds out at its next write
            assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
            assert job["id"] in runner_a.running  # still running where it runs
            # One more step, whose progress write finds the record gone; the engine waits at the next step until the
            # owner has told it to abort (this tiny model's steps take milliseconds, a store write may take longer).
            gate.allow(1)
            assert told_abort.wait(240), "the owner never told its engine to abort the deleted job"
        finally:
            gate.free()
        assert wait_until(lambda: engine_a.running_count == 0 and job["id"] not in runner_a.running, 240)
        assert a.get(f"/v1/videos/{job['id']}").status_code == 404
    assert sum(steps_with_it) <= 2, steps_with_it


@pytest.fixture(params=["memory", "sqlite", "redis"])
def two_stores(request, tmp_path):
    """Two processes' views of one state: the one memory store, or two connections to one SQLite file or one
    redis-server (a real one; a key prefix of this test's own)."""
    if request.param == "memory":
        store = MemoryStore()
        yield store, store
        return
    from store.store_backends import open_backend

    location, prefix = str(tmp_path / "state.db"), ""
    if request.param == "redis":
        location, prefix = request.getfixturevalue("redis_url"), f"takeover-{uuid.uuid4().hex[:8]}:"
    stores = open_backend(request.param, location, prefix), open_backend(request.param, location, prefix)
    yield stores
    for opened in stores:
        opened.close()


def test_a_dead_owners_job_is_taken_over_after_its_lease_and_completes(wan_executors, two_stores, tmp_path):
    (store, other), results = two_stores, Results(tmp_path, keep_s=3600)
    gate = SteppedExecutor(wan_executors[0])
    with app_client(gate, store=store, results=results, owner="a", lease_s=1.0) as a, \
            app_client(wan_executors[1], store=other, results=results, owner="b", poll_s=0.05) as b:
        b.app.state.server.jobs.runner.claiming = False  # b takes nothing until a has the job
        try:
            job = a.post("/v1/videos", json=QUICK).json()
            assert gate.wait_held(), "the job never reached its first step"
            die(a.app.state.server.jobs.runner)  # a dies: no word to the store, no more renewals
            held = store.get_job(job["id"])  # a may have claimed it again itself, had a stall outlived its lease
            assert held.owner == "a"
            b.app.state.server.jobs.runner.claiming = True
            done = wait_job(b, f"/v1/videos/{job['id']}")
        finally:
            gate.free()
        record = store.get_job(job["id"])
        mp4 = b.get(f"/v1/videos/{job['id']}/content")
    assert done["status"] == "completed", done
    assert record.owner == "b" and record.attempts > held.attempts  # b claimed it after a died
    assert mp4.status_code == 200 and mp4.content[4:8] == b"ftyp"


def test_events_from_another_process_follow_the_store_to_the_end(wan_executors, tmp_path):
    import json

    store, results = MemoryStore(), Results(tmp_path, keep_s=3600)
    with app_client(wan_executors[0], store=store, results=results, owner="a") as a, \
            app_client(wan_executors[1], store=store, results=results, owner="b", poll_s=3600) as b:
        job = a.post("/v1/videos", json={**QUICK, "num_inference_steps": 6}).json()
        with b.stream("GET", f"/v1/videos/{job['id']}/events") as r:
            events = [(e.split("\n")[0][len("event: "):], json.loads(e.split("\n")[1][len("data: "):]))
                      for e in r.read().decode().strip().split("\n\n")]
        assert b.get(f"/v1/videos/{job['id']}/content").content == a.get(f"/v1/videos/{job['id']}/content").content
    assert events[-1][0] == "video.completed" and events[-1][1]["progress"] == 100, events
    assert all(body["id"] == job["id"] for _, body in events)


class DurableMemoryStore(MemoryStore):
    """The memory store under another name: what a durable store does at a drain (jobs handed back) is then
    testable in one process."""

    url = "durable-memory"


def test_a_draining_process_hands_its_unfinished_jobs_back_to_a_durable_store(wan_executors, tmp_path):
    store, results = DurableMemoryStore(), Results(tmp_path, keep_s=3600)
    gate = SteppedExecutor(wan_executors[0])
    with app_client(gate, store=store, results=results, owner="a", shutdown_grace_s=0.0) as a:
        job = a.post("/v1/videos", json=SLOW).json()
        assert gate.wait_held(), "the job never reached its first step"
        queued = a.post("/v1/videos", json=SLOW).json()  # a second, waiting in the engine's queue
        gate.free()
    for job_id in (job["id"], queued["id"]):
        record = store.get_job(job_id)
        assert (record.status, record.owner, record.progress) == ("queued", None, 0), record
    with app_client(wan_executors[1], store=store, results=results, owner="b") as b:  # another takes them at once
        assert wait_job(b, f"/v1/videos/{queued['id']}", timeout_s=600)["status"] in ("completed", "in_progress")
        b.delete(f"/v1/videos/{job['id']}")
        b.delete(f"/v1/videos/{queued['id']}")


def test_a_restarted_owner_takes_its_orphans_back_at_once(wan_executors, tmp_path):
    """A job still held by this owner (its process was killed) is handed back when a process of that owner starts,
    without waiting for the lease (here 10 minutes)."""
    from stepserve.store.base import JobRecord

    store, results = DurableMemoryStore(), Results(tmp_path, keep_s=3600)
    with app_client(wan_executors[0], store=store, results=results, owner="a", poll_s=3600) as a:
        job = a.post("/v1/videos", json=QUICK).json()
        assert wait_job(a, f"/v1/videos/{job['id']}")["status"] == "completed"
        request = store.get_job(job["id"]).request
    made = store.get_job(job["id"])
    orphan = JobRecord("video_orphan", "video", request, store.now(), meta=made.meta, service=made.service)
    store.create_job(orphan)
    assert store.claim_job("a", lease_s=600) is not None  # as the killed process held it
    with app_client(wan_executors[1], store=store, results=results, owner="a", lease_s=600) as again:
        done = wait_job(again, "/v1/videos/video_orphan")
        assert done["status"] == "completed", done
        assert again.get("/v1/videos/video_orphan/content").content == \
            again.get(f"/v1/videos/{job['id']}/content").content  # the same request, the same video


def test_a_full_engine_queue_hands_the_job_back_for_later(wan_executors, tmp_path):
    from stepserve.server.schemas import ServerLimits

    store = CountingStore(MemoryStore())
    gate = SteppedExecutor(wan_executors[0])
    with app_client(gate, store=store, limits=ServerLimits(max_running_jobs=3), max_batch_size=1,
                    max_queue=1) as a:
        runner = a.app.state.server.jobs.runner
        try:
            first = a.post("/v1/videos", json=SLOW).json()
            assert gate.wait_held(), "the first job never reached its first step"
            second = a.post("/v1/videos", json=QUICK).json()  # the engine's one queue place
            third = a.post("/v1/videos", json=QUICK).json()  # refused by the engine: handed back
            assert wait_until(lambda: "release_job" in store.calls and store.get_job(third["id"]).owner is None,
                              240), store.get_job(third["id"])
            assert {first["id"], second["id"]} <= set(runner.running)  # the third comes and goes, refused again
            assert a.get(f"/v1/videos/{third['id']}").json()["status"] == "queued"
            assert a.app.state.server.engine.queue_depth == 1 and gate.held_requests == 1
            a.delete(f"/v1/videos/{first['id']}")
        finally:
            gate.free()
        assert wait_job(a, f"/v1/videos/{second['id']}")["status"] == "completed"
        assert wait_job(a, f"/v1/videos/{third['id']}")["status"] == "completed"
        assert store.get_job(third["id"]).attempts == 1  # the hand-backs gave their claims back


def test_a_finished_job_with_a_webhook_is_notified_once(wan_executors, tmp_path):
    store = MemoryStore()
    hook = {"webhook": "http://127.0.0.1:9/hook"}
    with app_client(wan_executors[0], store=store, webhook_secret="s3cret", webhook_allow=["127.0.0.1"]) as a:
        sender = a.app.state.server.jobs.runner.sender = RecordingSender()
        done = a.post("/v1/videos", json={**QUICK, **hook}).json()
        failed = a.post("/v1/videos", json={**QUICK, **hook, "timeout_s": 1e-6}).json()  # its deadline passes
        plain = a.post("/v1/videos", json=QUICK).json()  # no webhook: no notification
        image = a.post("/v1/images/generations", json={"prompt": "a", "num_inference_steps": 2, **hook},
                       headers={"Prefer": "respond-async"}).json()
        shown = {j["id"]: wait_job(a, path) for j, path in ((done, f"/v1/videos/{done['id']}"),
                                                             (failed, f"/v1/videos/{failed['id']}"),
                                                             (plain, f"/v1/videos/{plain['id']}"),
                                                             (image, f"/v1/images/jobs/{image['id']}"))}
        assert wait_until(lambda: len(sender.delivered) == 3, 240)
    sent = {job.id: (payload, owner) for job, payload, owner in sender.delivered}
    assert set(sent) == {done["id"], failed["id"], image["id"]}
    types = {job_id: payload["type"] for job_id, (payload, _) in sent.items()}
    assert types == {done["id"]: "video.completed", failed["id"]: "video.failed", image["id"]: "image.completed"}
    for job_id, (payload, owner) in sent.items():
        assert payload["data"] == {k: v for k, v in shown[job_id].items() if k != "result"}  # results not inlined
        assert payload["timestamp"].endswith("Z")
        assert owner == a.app.state.server.jobs.owner
    assert shown[done["id"]]["stepserve"]["webhook"]["url"] == hook["webhook"]


def test_a_job_whose_lease_lapsed_under_its_own_runner_runs_there_once(wan_executors):
    """A runner that claims a job it is running (its lease lapsed: a stalled event loop, say) keeps its one run
    of it; it had started a second, which submitted the job to the engine again."""
    store = MemoryStore()
    gate = SteppedExecutor(wan_executors[0])
    with app_client(gate, store=store, owner="a") as a:
        engine, runner = a.app.state.server.engine, a.app.state.server.jobs.runner
        submitted = []
        submit = engine.submit_many_off_loop

        async def counted(*args, **kwargs):
            submitted.append(args)
            return await submit(*args, **kwargs)

        engine.submit_many_off_loop = counted
        try:
            job = a.post("/v1/videos", json=SLOW).json()
            assert gate.wait_held(), "the job never reached its first step"
            store.update_job(job["id"], lease_until=0.0)  # as if it had not been renewed in time
            runner.wake()
            assert wait_until(lambda: store.get_job(job["id"]).attempts == 2, 240), "never claimed again"
            assert wait_until(lambda: runner.running[job["id"]].handles, 240)  # the run it has now: submitted
            assert len(submitted) == 1 and engine.queue_depth == 0 and gate.held_requests == 1
            a.delete(f"/v1/videos/{job['id']}")
        finally:
            gate.free()
