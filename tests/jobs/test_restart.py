"""A single server on a durable state (`--state sqlite:///...`), SIGKILLed with one video job in progress and one
queued, restarted on the same state and port: both jobs complete, each video the one an uninterrupted run makes
(its seed, drawn at creation, was kept with the job), and a job completed before the kill still downloads."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from extras import require
from job_helpers import wan_folder  # noqa: F401  (fixtures)
from store.redis_server import redis_url  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 240  # bounds a hang only


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model, port: int, flags: list[str], held_steps: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "stepserve.cli", "serve"]
    if held_steps is not None:
        command, env["STEPSERVE_TEST_STEPS"] = [sys.executable, str(Path(__file__).with_name("held_serve.py"))], \
            str(held_steps)
    return subprocess.Popen([*command, "--model", str(model), "--port", str(port), "--threads", "1",
                             "--log-level", "warning", "--no-memory-cap", *flags], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def until(predicate, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + HANG_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited while waiting for {what}: {proc.stderr.read()}")
        try:
            value = predicate()
        except httpx.TransportError:
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def frames(mp4: bytes) -> np.ndarray:
    sys.path.insert(0, str(ROOT / "tests" / "server"))
    from video_helpers import mp4_frames

    return mp4_frames(mp4)


@pytest.fixture(params=["sqlite", "redis"])
def state_url(request, tmp_path):
    """A durable state of each backend (Redis: a real redis-server, a database of this test's own)."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url").rsplit("/", 1)[0] + "/9"
    return f"sqlite:///{tmp_path / 'state' / 'state.db'}"


@pytest.mark.slow  # two server start-ups: 50 s here
def test_a_killed_server_restarted_on_its_state_finishes_its_jobs(wan_folder, state_url, tmp_path):
    require("imageio_ffmpeg", "video")
    port, url = free_port(), None
    url = f"http://127.0.0.1:{port}"
    flags = ["--state", state_url, "--results", str(tmp_path / "results"), "--max-batch-size", "1",
             "--job-lease-s", "600"]  # a lease far longer than the test: only the restart's own claim is in time
    quick = {"prompt": "a lighthouse", "num_frames": 5, "num_inference_steps": 2, "seed": 7}
    long = {"prompt": "a red fox", "num_frames": 5, "num_inference_steps": 6}  # no seed: one is drawn and kept
    queued = {"prompt": "a boat", "num_frames": 5, "num_inference_steps": 3}
    first = start(wan_folder, port, flags, held_steps=2 + 2)  # the quick job's 2 steps, then 2 of the long one
    try:
        http = httpx.Client(base_url=url, timeout=60)
        until(lambda: http.get("/health").status_code == 200, "the first server to start", first)
        done = http.post("/v1/videos", json=quick).json()
        running = http.post("/v1/videos", json=long).json()
        waiting = http.post("/v1/videos", json=queued).json()
        until(lambda: http.get(f"/v1/videos/{done['id']}").json()["status"] == "completed", "the quick job", first)
        before = http.get(f"/v1/videos/{done['id']}/content").content
        until(lambda: http.get(f"/v1/videos/{running['id']}").json()["progress"] > 0, "the long job's steps", first)
        assert http.get(f"/v1/videos/{running['id']}").json()["status"] == "in_progress"
        assert http.get(f"/v1/videos/{waiting['id']}").json()["status"] == "queued"
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    second = start(wan_folder, port, flags)
    try:
        http = httpx.Client(base_url=url, timeout=60)
        until(lambda: http.get("/health").status_code == 200, "the restarted server to start", second)
        after = http.get(f"/v1/videos/{done['id']}/content")
        assert after.status_code == 200 and after.content == before  # kept across the restart
        ended = {job["id"]: until(lambda job=job: (lambda b: b if b["status"] in ("completed", "failed") else None)(
            http.get(f"/v1/videos/{job['id']}").json()), "the jobs to end", second) for job in (running, waiting)}
        assert [b["status"] for b in ended.values()] == ["completed", "completed"], ended
        videos = {job_id: http.get(f"/v1/videos/{job_id}/content").content for job_id in ended}
        seed = ended[running["id"]]["stepserve"]["seed"]
        assert seed == running["stepserve"]["seed"]  # drawn when it was created, kept with it
        again = {job_id: http.post("/v1/videos", json={**body, "seed": ended[job_id]["stepserve"]["seed"]}).json()
                 for job_id, body in ((running["id"], long), (waiting["id"], queued))}
        for job_id, fresh in again.items():  # uninterrupted runs of the same requests
            until(lambda: http.get(f"/v1/videos/{fresh['id']}").json()["status"] == "completed", "a fresh run",
                  second)
            assert np.array_equal(frames(videos[job_id]), frames(http.get(f"/v1/videos/{fresh['id']}/content")
                                                                   .content)), job_id
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.communicate(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            second.kill()
            second.communicate()
