"""The video routes over the store: GET .../content answers HTTP Range through the real route (206 and those
bytes), an Idempotency-Key returns the video job made earlier (the same key for another request: 409), and an async
image job's events end with it."""

from __future__ import annotations

import json

import pytest
from extras import require
from job_helpers import app_client, wait_job
from job_helpers import wan_folder  # noqa: F401  (fixtures)
from server.server_helpers import assert_error_shape

from stepserve.engine.loading import load_executor

QUICK = {"prompt": "a fox", "num_frames": 5, "num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def wan(wan_folder):
    require("imageio_ffmpeg", "video")
    return load_executor(str(wan_folder))


def test_content_answers_range_requests(wan):
    with app_client(wan) as c:
        job = c.post("/v1/videos", json=QUICK).json()
        assert wait_job(c, f"/v1/videos/{job['id']}")["status"] == "completed"
        whole = c.get(f"/v1/videos/{job['id']}/content")
        head = c.get(f"/v1/videos/{job['id']}/content", headers={"Range": "bytes=0-99"})
        tail = c.get(f"/v1/videos/{job['id']}/content", headers={"Range": "bytes=-10"})
        beyond = c.get(f"/v1/videos/{job['id']}/content", headers={"Range": f"bytes={len(whole.content)}-"})
    assert whole.status_code == 200 and whole.headers["accept-ranges"] == "bytes" and len(whole.content) > 100
    assert head.status_code == 206 and head.content == whole.content[:100]
    assert head.headers["content-range"] == f"bytes 0-99/{len(whole.content)}"
    assert head.headers["content-type"] == "video/mp4"
    assert tail.status_code == 206 and tail.content == whole.content[-10:]
    assert beyond.status_code == 416


def test_an_idempotency_key_returns_the_video_job_made_earlier(wan):
    with app_client(wan) as c:
        key = {"Idempotency-Key": "render-42"}
        first = c.post("/v1/videos", json=QUICK, headers=key).json()
        again = c.post("/v1/videos", json=QUICK, headers=key)
        other = c.post("/v1/videos", json={**QUICK, "seed": 4}, headers=key)
        image = c.post("/v1/images/generations", json={"prompt": "a", "num_inference_steps": 2}, headers={
            **key, "Prefer": "respond-async"})  # another kind of job: its own keys
        listed = c.get("/v1/videos").json()["data"]
        wait_job(c, f"/v1/images/jobs/{image.json()['id']}")
    assert again.status_code == 200 and again.json()["id"] == first["id"]
    assert assert_error_shape(other, 409)["param"] == "Idempotency-Key"
    assert image.status_code == 202
    assert [v["id"] for v in listed] == [first["id"]]


def test_an_image_jobs_events_end_with_it(wan):
    with app_client(wan) as c:
        job = c.post("/v1/images/generations", json={"prompt": "a", "num_inference_steps": 4, "size": "32x32"},
                     headers={"Prefer": "respond-async"}).json()
        with c.stream("GET", f"/v1/images/jobs/{job['id']}/events") as r:
            events = [(e.split("\n")[0][len("event: "):], json.loads(e.split("\n")[1][len("data: "):]))
                      for e in r.read().decode().strip().split("\n\n")]
    names = [name for name, _ in events]
    assert names[-1] == "image.completed" and set(names) <= {"image.queued", "image.in_progress", "image.completed"}
    assert events[-1][1]["result"]["data"][0]["b64_json"], events[-1]
    progress = [body["progress"] for _, body in events]
    assert progress == sorted(progress) and progress[-1] == 100
