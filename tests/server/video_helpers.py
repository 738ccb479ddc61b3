"""Helpers of the video endpoint's tests (test_videos.py, test_video_limits.py): a test client on a Wan server,
waiting for a job, what /health and /metrics say, and MP4s decoded to compare with WanPipeline's video."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
from extras import require
from fastapi.testclient import TestClient

from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app


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


def sample(metrics: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + " "))
