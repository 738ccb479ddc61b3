"""The videos endpoint on a Wan server: a job's life (queued, in progress, completed; an MP4 of the right frames that
shows WanPipeline's video), its progress as server-sent events, deletion, the bound on kept jobs, overload and bad
input refused per request; and a video and image requests served at once by one server, each its own answer."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from extras import require
from server_helpers import GENERATIONS, assert_error_shape, decode_png, pixels, wait_until
from step_gate import SteppedExecutor
from stepserve import SamplingParams
from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app
from stepserve.server.schemas import ServerLimits
from wan_reference import reference_video


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan_http") / "pipe")


@pytest.fixture(scope="module")
def wan_executor(wan):
    from stepserve.engine.loading import load_executor

    return load_executor(str(wan))


def client(executor, limits=None, api_key=None, **options) -> TestClient:
    options = {"strategy": "continuous", "max_batch_size": 4, **options}
    return TestClient(create_app(AsyncEngine(executor, **options), api_key=api_key, limits=limits))


def wait_done(c: TestClient, video_id: str, timeout_s: float = 240, headers=None) -> dict:
    """The job once it has finished (or, should it hang, as it is after `timeout_s`: the caller's assertion shows
    it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = c.get(f"/v1/videos/{video_id}", headers=headers).json()
        if body["status"] in ("completed", "failed") or time.monotonic() > deadline:
            return body
        time.sleep(0.02)


def health(c: TestClient) -> dict:
    """What the server reports of its engine: queue_depth (requests waiting for a slot) and running."""
    return c.get("/health").json()


def mp4_frames(data: bytes) -> np.ndarray:
    """(frames, H, W, 3) decoded from MP4 bytes with the bundled ffmpeg."""
    imageio_ffmpeg = require("imageio_ffmpeg", "video")
    with tempfile.NamedTemporaryFile(suffix=".mp4", delete=False) as f:
        f.write(data)
    try:
        reader = imageio_ffmpeg.read_frames(f.name)
        meta = next(reader)
        w, h = meta["size"]
        return np.stack([np.frombuffer(b, np.uint8).reshape(h, w, 3) for b in reader]).astype(np.int16)
    finally:
        os.unlink(f.name)


def as_mp4(video: np.ndarray, fps: int = 16) -> np.ndarray:
    """A reference video as it looks through the same (lossy) encoder: what the MP4 of that video decodes to."""
    from PIL import Image

    from stepserve.server.mp4 import encode_mp4

    return mp4_frames(encode_mp4([Image.fromarray(f.astype(np.uint8)) for f in video], fps))


def test_a_video_job_from_creation_to_mp4(wan, wan_executor):
    require("imageio_ffmpeg", "video")
    body = {"prompt": "a red fox running", "size": "32x48", "seconds": "0.25", "seed": 11,
            "num_inference_steps": 3, "guidance_scale": 4.0, "negative_prompt": "blurry", "sampler": "flow_euler"}
    with client(wan_executor) as c:
        created = c.post("/v1/videos", json=body)
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["object"] == "video" and job["id"].startswith("video_")
        assert job["status"] in ("queued", "in_progress") and 0 <= job["progress"] < 100
        assert (job["model"], job["size"], job["seconds"]) == ("pipe", "32x48", "0.25")
        assert job["stepserve"]["num_frames"] == 5 and job["stepserve"]["fps"] == 16
        done = wait_done(c, job["id"])
        assert (done["status"], done["progress"], done["error"]) == ("completed", 100, None), done
        content = c.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        assert content.content[4:8] == b"ftyp"
        listed = c.get("/v1/videos").json()
        assert [v["id"] for v in listed["data"]] == [job["id"]]
        deleted = c.delete(f"/v1/videos/{job['id']}").json()
        assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True}
        assert_error_shape(c.get(f"/v1/videos/{job['id']}"), 404)
    frames = mp4_frames(content.content)
    assert frames.shape == (5, 48, 32, 3)
    p = SamplingParams(prompt=body["prompt"], negative_prompt="blurry", seed=11, num_inference_steps=3,
                       guidance_scale=4.0, sampler="flow_euler", height=48, width=32, num_frames=5)
    want, other = reference_video(wan, p), reference_video(wan, SamplingParams(**{**vars(p), "seed": 12}))
    near, far = np.abs(frames - as_mp4(want)).mean(), np.abs(frames - as_mp4(other)).mean()
    assert near < 0.5 and far > 1, (near, far)


def test_progress_streams_as_server_sent_events(wan_executor):
    require("imageio_ffmpeg", "video")
    with client(wan_executor) as c:
        with c.stream("POST", "/v1/videos", json={"prompt": "a boat", "num_frames": 5, "seed": 2, "stream": True,
                                                  "num_inference_steps": 4, "guidance_scale": 1.0}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [(e.split("\n")[0][len("event: "):], json.loads(e.split("\n")[1][len("data: "):]))
                      for e in r.read().decode().strip().split("\n\n")]
    names = [name for name, _ in events]
    assert names[0] in ("video.queued", "video.in_progress") and names[-1] == "video.completed", names
    progress = [body["progress"] for _, body in events]
    assert progress == sorted(progress) and progress[-1] == 100 and len(set(progress)) >= 3, progress


def test_a_video_and_images_at_once_each_get_their_own_answer(wan, wan_executor):
    """One Wan server: a 5-frame video job and a 1-frame request on /v1/images/generations run in the same engine
    at the same time (in their own (frames, height, width) buckets); the image equals WanPipeline's one-frame
    output, the video its video."""
    require("imageio_ffmpeg", "video")
    steps: list[set] = []
    gate = SteppedExecutor(wan_executor)  # the video's first step waits until the images are queued beside it
    with client(gate) as c:
        engine = c.app.state.server.engine
        engine.on_step.append(lambda report: steps.append({r.params.num_frames for r in report.progressed}))
        video = c.post("/v1/videos", json={"prompt": "a lighthouse", "size": "32x32", "num_frames": 5,
                                           "seed": 3, "num_inference_steps": 30, "guidance_scale": 4.0}).json()
        images = {}

        def post_images():
            images["answer"] = c.post(GENERATIONS, json={"prompt": "seven", "size": "32x32", "n": 2, "seed": 40,
                                                         "num_inference_steps": 3, "guidance_scale": 3.0,
                                                         "negative_prompt": "dark"})

        thread = threading.Thread(target=post_images)
        try:
            assert gate.wait_held(), "the video never reached its first step"
            thread.start()
            assert wait_until(lambda: engine.queue_depth == 2, 240), "the images were never queued"
        finally:
            gate.free()
        thread.join(240)
        done = wait_done(c, video["id"])
        assert done["status"] == "completed", done
        mp4 = c.get(f"/v1/videos/{video['id']}/content").content
    answer = images["answer"]
    assert answer.status_code == 200, answer.text
    video_steps = [i for i, s in enumerate(steps) if 5 in s]
    image_steps = [i for i, s in enumerate(steps) if 1 in s]
    # served at once: the image steps and the video steps interleave (each step runs one bucket)
    assert video_steps[0] < image_steps[-1] and image_steps[0] < video_steps[-1], (video_steps, image_steps)
    for k, item in enumerate(answer.json()["data"]):
        p = SamplingParams(prompt="seven", negative_prompt="dark", seed=40 + k, num_inference_steps=3,
                           guidance_scale=3.0, sampler="dpmpp_2m", height=32, width=32, num_frames=1)
        assert np.abs(pixels(decode_png(item["b64_json"])) - reference_video(wan, p)[0]).max() <= 1
    p = SamplingParams(prompt="a lighthouse", seed=3, num_inference_steps=30, guidance_scale=4.0,
                       sampler="dpmpp_2m", height=32, width=32, num_frames=5)
    assert np.abs(mp4_frames(mp4) - as_mp4(reference_video(wan, p))).mean() < 0.5


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "a", "num_frames": 4}, "num_frames", "1 + a multiple of 4 from 1 to 9"),
    ({"prompt": "a", "seconds": "2"}, "seconds", "from 0 to 0.5 (9 frames at 16 fps)"),
    ({"prompt": "a", "seconds": 10 ** 400}, "seconds", "from 0 to 0.5"),  # too large for a float: still a 400
    ({"prompt": "a", "seconds": "0.25", "num_frames": 5}, "seconds", "not both"),
    ({"prompt": "a", "sampler": "unipc"}, "sampler", "allowed: dpmpp_2m, flow_euler"),
    ({"prompt": "a", "size": "40x32"}, "size", "multiple of 16"),
    ({"prompt": "a", "fps": 0}, "fps", "from 1 to 60"),
    ({"prompt": "a", "input_reference": "x"}, "input_reference", "not served"),
    ({"prompt": "a", "frames": 5}, "frames", "unknown field"),
])
def test_bad_video_requests_are_400_naming_the_field(wan_executor, body, param, says):
    require("imageio_ffmpeg", "video")
    with client(wan_executor) as c:
        error = assert_error_shape(c.post("/v1/videos", json=body), 400)
    assert error["param"] == param and says in error["message"], error


def test_job_states_bounds_overload_and_the_api_key(wan_executor):
    """Every step of the slow jobs runs only when the test allows it, so which jobs are running, queued or kept is
    the test's doing and not the machine's speed; each admission is asserted once the server reports the state it
    depends on (a deleted job leaves the engine's queue at the engine's next step)."""
    require("imageio_ffmpeg", "video")
    slow = {"prompt": "a", "num_frames": 9, "num_inference_steps": 200}
    gate = SteppedExecutor(wan_executor)
    auth = {"Authorization": "Bearer k"}
    with client(gate, limits=ServerLimits(max_video_jobs=3), api_key="k", max_batch_size=2, max_queue=1) as c:
        try:
            assert_error_shape(c.post("/v1/videos", json=slow), 401)
            first = c.post("/v1/videos", json=slow, headers=auth).json()
            assert gate.wait_held(), "the first job never reached its first step"  # running: out of the queue
            second = c.post("/v1/videos", json=slow, headers=auth).json()  # joins no batch before the next step
            assert health(c)["queue_depth"] == 1, "the second job should hold the queue's one place"
            error = assert_error_shape(c.get(f"/v1/videos/{first['id']}/content", headers=auth), 409)
            assert error["code"] == "video_not_ready"
            queue_full = c.post("/v1/videos", json=slow, headers=auth)  # the store has room, the queue has not
            assert_error_shape(queue_full, 429)
            assert queue_full.json()["error"]["code"] == "queue_full" and "retry-after" in queue_full.headers
            assert "queue is full" in queue_full.json()["error"]["message"]
            c.delete(f"/v1/videos/{second['id']}", headers=auth)
            gate.allow(1)  # the step in progress ends; the next one drops the deleted job from the queue
            assert wait_until(lambda: health(c)["queue_depth"] == 0, 240), "the deleted job kept its queue place"
            third = c.post("/v1/videos", json=slow, headers=auth)  # takes the queue's place the deleted job left
            assert third.status_code == 200, third.text
            gate.allow(1)  # the next step admits it beside the first: both running, the queue empty again
            assert wait_until(lambda: health(c)["queue_depth"] == 0, 240), "the third job never started"
            fourth = c.post("/v1/videos", json=slow, headers=auth)
            assert fourth.status_code == 200, fourth.text
            full = c.post("/v1/videos", json=slow, headers=auth)  # three jobs kept, none finished
            assert_error_shape(full, 429)
            assert "still running" in full.json()["error"]["message"] and int(full.headers["retry-after"]) >= 1
            kept = c.get("/v1/videos", headers=auth).json()["data"]
            assert {job["id"] for job in kept} == {first["id"], third.json()["id"], fourth.json()["id"]}
            for job in kept:
                c.delete(f"/v1/videos/{job['id']}", headers=auth)
        finally:
            gate.free()
        engine = c.app.state.server.engine  # deleted jobs leave the engine at its next step
        assert wait_until(lambda: engine.queue_depth == 0 and engine.running_count == 0, 240)
        quick = c.post("/v1/videos", json={"prompt": "b", "num_inference_steps": 2}, headers=auth).json()
        assert wait_done(c, quick["id"], headers=auth)["status"] == "completed"
        later = []
        for _ in range(3):  # the store is full again: the oldest finished job makes room
            later.append(c.post("/v1/videos", json={"prompt": "b", "num_inference_steps": 2}, headers=auth).json())
            assert wait_until(lambda: health(c)["queue_depth"] == 0, 240)  # the queue's one place is free again
        assert_error_shape(c.get(f"/v1/videos/{quick['id']}", headers=auth), 404)
        assert all(wait_done(c, v["id"], headers=auth)["status"] == "completed" for v in later)
        metrics = c.get("/metrics", headers=auth).text
    # each request counted once by how it ended: the 401; both 429s (the engine's queue full, refused at admission;
    # the store full); every job deleted before it finished (`second`, then the three kept); the four completed
    jobs = {o: sample(metrics, f'stepserve_video_jobs_total{{outcome="{o}"}}')
            for o in ("unauthorized", "rejected", "cancelled", "completed")}
    assert jobs == {"unauthorized": 1, "rejected": 2, "cancelled": 4, "completed": 4}, jobs
    assert sample(metrics, "stepserve_rejected_total") == 2
    assert sample(metrics, 'stepserve_refused_at_admission_total{reason="queue_full"}') == 1


def test_an_image_model_refuses_videos(tiny_executor):
    with client(tiny_executor) as c:
        error = assert_error_shape(c.post("/v1/videos", json={"prompt": "a", "num_frames": 5}), 400)
    assert error["code"] == "model_not_video" and "makes images, not videos" in error["message"]


def sample(metrics: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + " "))


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
        running = c.post("/v1/videos", json=slow).json()  # drops the finished job: the store keeps one
        assert c.post("/v1/videos", json=slow).status_code == 429  # the one kept is still running
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
