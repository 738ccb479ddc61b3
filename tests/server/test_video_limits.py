"""The videos endpoint's bounds on a Wan server: jobs running here, waiting in the store, the API key; and every POST
/v1/videos counted and logged once, however it ended (completed, invalid, refused, deleted, past its deadline, cut
short by shutdown)."""

from __future__ import annotations

from extras import require
from fastapi.testclient import TestClient
from server_helpers import assert_error_shape, wait_until
from step_gate import SteppedExecutor
from video_helpers import client, health, sample, wait_done

from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app
from stepserve.server.schemas import ServerLimits


def test_job_states_bounds_overload_and_the_api_key(wan_executor):
    """Every step of the slow jobs runs only when the test allows it, so which jobs are running, queued or kept is
    the test's doing and not the machine's speed; each admission is asserted once the server reports the state it
    depends on (a deleted job leaves the engine's queue at the engine's next step). This process runs as many jobs
    at once as a batch holds (2); more wait in the store, queued; beyond max_video_jobs waiting or running, 429.
    Finished jobs stay (until swept) and do not count against the bound."""
    require("imageio_ffmpeg", "video")
    slow = {"prompt": "a", "num_frames": 9, "num_inference_steps": 200}
    gate = SteppedExecutor(wan_executor)
    auth = {"Authorization": "Bearer k"}
    with client(gate, limits=ServerLimits(max_video_jobs=3), api_key="k", max_batch_size=2, max_queue=1) as c:
        runner = c.app.state.server.jobs.runner
        try:
            assert_error_shape(c.post("/v1/videos", json=slow), 401)
            first = c.post("/v1/videos", json=slow, headers=auth).json()
            assert gate.wait_held(), "the first job never reached its first step"  # running: out of the queue
            second = c.post("/v1/videos", json=slow, headers=auth).json()  # joins no batch before the next step
            assert wait_until(lambda: health(c)["queue_depth"] == 1, 240), "the second job never reached the engine"
            error = assert_error_shape(c.get(f"/v1/videos/{first['id']}/content", headers=auth), 409)
            assert error["code"] == "video_not_ready"
            third = c.post("/v1/videos", json=slow, headers=auth)  # this process runs two: it waits in the store
            assert third.status_code == 200 and third.json()["status"] == "queued", third.text
            assert set(runner.running) == {first["id"], second["id"]} and health(c)["queue_depth"] == 1
            full = c.post("/v1/videos", json=slow, headers=auth)  # three waiting or running: the bound
            assert_error_shape(full, 429)
            assert full.json()["error"]["code"] == "queue_full" and int(full.headers["retry-after"]) >= 1
            assert "3 video jobs are queued or running" in full.json()["error"]["message"]
            c.delete(f"/v1/videos/{second['id']}", headers=auth)
            gate.allow(2)  # the step in progress ends; the next drops the deleted job, which leaves room once it ends
            submitted = lambda: runner.running.get(third.json()["id"]) and runner.running[third.json()["id"]].handles
            assert wait_until(submitted, 240), "the third job was never claimed and submitted to the engine"
            kept = c.get("/v1/videos", headers=auth).json()["data"]
            assert [job["id"] for job in kept] == [third.json()["id"], first["id"]]  # newest first
            fourth = c.post("/v1/videos", json=slow, headers=auth)  # the bound has room again
            assert fourth.status_code == 200, fourth.text
            for job in (first, third.json(), fourth.json()):
                c.delete(f"/v1/videos/{job['id']}", headers=auth)
        finally:
            gate.free()
        engine = c.app.state.server.engine  # deleted jobs leave the engine at its next step
        assert wait_until(lambda: engine.queue_depth == 0 and engine.running_count == 0, 240)
        quick = c.post("/v1/videos", json={"prompt": "b", "num_inference_steps": 2}, headers=auth).json()
        assert wait_done(c, quick["id"], headers=auth)["status"] == "completed"
        later = [c.post("/v1/videos", json={"prompt": "b", "num_inference_steps": 2}, headers=auth).json()
                 for _ in range(3)]  # finished jobs do not count: three more fit
        assert all(wait_done(c, v["id"], headers=auth)["status"] == "completed" for v in later)
        assert c.get(f"/v1/videos/{quick['id']}", headers=auth).json()["status"] == "completed"  # still kept
        metrics = c.get("/metrics", headers=auth).text
    # each request counted once by how it ended: the 401; the 429 (the bound); every job deleted before it
    # finished (first, second, third, fourth); the four completed
    jobs = {o: sample(metrics, f'stepserve_video_jobs_total{{outcome="{o}"}}')
            for o in ("unauthorized", "rejected", "cancelled", "completed")}
    assert jobs == {"unauthorized": 1, "rejected": 1, "cancelled": 4, "completed": 4}, jobs
    assert sample(metrics, "stepserve_rejected_total") == 1
    assert sample(metrics, 'stepserve_refused_at_admission_total{reason="queue_full"}') == 0


def test_every_video_request_ends_in_the_metrics_and_the_access_log_once(wan_executor, caplog):
    """A POST /v1/videos refused at once is counted and logged then; one that made a job, at the job's end (its
    outcome how the job ended): completed, cancelled by DELETE; every 429 is in stepserve_rejected_total."""
    import logging
    import re

    require("imageio_ffmpeg", "video")
    caplog.set_level(logging.INFO, logger="stepserve.access")
    slow = {"prompt": "a", "num_frames": 9, "num_inference_steps": 200}
    with client(wan_executor, limits=ServerLimits(max_video_jobs=1), max_batch_size=1) as c:
        quick = c.post("/v1/videos", json={"prompt": "b", "num_inference_steps": 2, "seed": 1}).json()
        assert wait_done(c, quick["id"])["status"] == "completed"
        assert c.post("/v1/videos", json={"prompt": "b", "num_frames": 4}).status_code == 400
        running = c.post("/v1/videos", json=slow).json()  # finished jobs do not count against the bound
        assert c.post("/v1/videos", json=slow).status_code == 429  # one is waiting or running: the bound
        c.delete(f"/v1/videos/{running['id']}")
        metrics = c.get("/metrics").text

    jobs = {o: sample(metrics, f'stepserve_video_jobs_total{{outcome="{o}"}}')
            for o in ("completed", "invalid", "rejected", "cancelled", "failed")}
    assert jobs == {"completed": 1, "invalid": 1, "rejected": 1, "cancelled": 1, "failed": 0}, jobs
    assert sample(metrics, 'stepserve_video_job_seconds_count{outcome="completed"}') == 1
    assert sample(metrics, "stepserve_rejected_total") == 1 and sample(metrics, "stepserve_cancelled_total") == 1
    assert sample(metrics, 'stepserve_requests_total{outcome="completed"}') == 0  # the image requests' series
    lines = [r.getMessage() for r in caplog.records if r.name == "stepserve.access"]
    assert len(lines) == 4, lines
    assert re.fullmatch(rf"POST /v1/videos 200 completed \d+\.\d{{3}} s id={quick['id']} frames=\d+ n=1 steps=2 "
                        r"batch=1-1", lines[0]), lines
    assert re.fullmatch(r"POST /v1/videos 400 invalid \d+\.\d{3} s", lines[1]), lines
    assert re.fullmatch(r"POST /v1/videos 429 rejected \d+\.\d{3} s", lines[2]), lines
    assert re.fullmatch(rf"POST /v1/videos 200 cancelled \d+\.\d{{3}} s id={running['id']}", lines[3]), lines


def test_a_job_past_its_deadline_and_one_cut_short_by_shutdown_each_end_once(wan_executor, caplog):
    """A job whose request times out ends as `timeout` (counted in stepserve_timed_out_total too); a job still
    running when the server shuts down ends once, whichever way (the engine's answer or the cut at close)."""
    import logging

    require("imageio_ffmpeg", "video")
    caplog.set_level(logging.INFO, logger="stepserve.access")
    slow = {"prompt": "a", "num_frames": 9, "num_inference_steps": 200}
    app_client = TestClient(create_app(AsyncEngine(wan_executor, strategy="continuous", max_batch_size=1),
                                       limits=ServerLimits(default_timeout_s=0.5), shutdown_grace_s=0.1))
    with app_client as c:
        late = c.post("/v1/videos", json=slow).json()
        done = wait_done(c, late["id"])
        assert done["status"] == "failed" and done["error"]["code"] == "deadline_exceeded", done
        metrics = c.get("/metrics").text
        assert sample(metrics, 'stepserve_video_jobs_total{outcome="timeout"}') == 1
        assert sample(metrics, "stepserve_timed_out_total") == 1
        running = c.post("/v1/videos", json={**slow, "timeout_s": 600}).json()
        state = c.app.state.server
        assert wait_until(lambda: state.engine.running_count == 1, 240)
    lines = [r.getMessage() for r in caplog.records if r.name == "stepserve.access"]
    assert len([ln for ln in lines if late["id"] in ln]) == 1 and " timeout " in lines[0], lines
    ends = [ln for ln in lines if running["id"] in ln]
    assert len(ends) == 1, lines
    after = state.metrics.render().decode()
    assert sum(sample(after, f'stepserve_video_jobs_total{{outcome="{o}"}}')
               for o in ("completed", "failed", "timeout", "cancelled", "shutting_down")) == 2
