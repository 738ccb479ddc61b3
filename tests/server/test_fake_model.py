"""`serve --model fake --latency-model FILE`: the simulated accelerator. It serves the whole API as a model does
(generations, jobs with their webhook, the console's step stream) with cheap deterministic pictures, and each
stage sleeps at least what the latency model charges (a lower bound only: the suite runs on busy machines)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_helpers import GENERATIONS, decode_png, wait_until
from several_models import front_of

from stepserve.costs import LatencyCharges, LatencyModel
from stepserve.server.startup import StartupError

LATENCY = Path(__file__).resolve().parents[2] / "stepserve/models/latency/gpu-sd15-512.json"
FAKE = ("--model", "fake", "--latency-model", str(LATENCY))


def generate(url: str, **fields) -> httpx.Response:
    body = {"prompt": "a lighthouse", "num_inference_steps": 4, "seed": 7, **fields}
    return httpx.post(url + GENERATIONS, json=body, timeout=60)


def test_the_fake_serves_pictures_of_the_seed_at_the_latency_models_speed():
    latency = LatencyModel.load(LATENCY)
    with front_of(*FAKE, "--strategy", "continuous") as (server, _front):
        models = httpx.get(server.url + "/v1/models").json()["data"]
        a, again = generate(server.url), generate(server.url)
        other_seed, more_steps = generate(server.url, seed=8), generate(server.url, num_inference_steps=9)
        wide = generate(server.url, size="384x256")
    assert [(m["id"], m["family"]) for m in models] == [("fake", "fake")]
    for answer in (a, again, other_seed, more_steps, wide):
        assert answer.status_code == 200, answer.text
    image = decode_png(a.json()["data"][0]["b64_json"])
    assert image.size == latency.reference_bucket[::-1]  # no size asked: the latency model's reference size
    assert decode_png(wide.json()["data"][0]["b64_json"]).size == (384, 256)
    assert a.json()["data"] == again.json()["data"]  # deterministic
    assert other_seed.json()["data"] != a.json()["data"] and more_steps.json()["data"] != a.json()["data"]
    info = a.json()["stepserve"]["images"][0]
    one = SimpleNamespace(bucket=latency.reference_bucket, params=SimpleNamespace(guidance_scale=info["guidance_scale"]))
    step = LatencyCharges(latency).step_s([one])
    assert step > 0 and info["denoise_s"] >= 4 * step * 0.99, info  # it slept at least what each step charges


def test_a_fake_job_completes_and_calls_its_webhook(tmp_path):
    calls: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            calls.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    receiver = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    hook = f"http://127.0.0.1:{receiver.server_port}/hook"
    try:
        with front_of(*FAKE, "--webhook-secret", "s3cret", "--webhook-allow", "127.0.0.1") as (server, _front):
            created = httpx.post(server.url + GENERATIONS, json={"prompt": "a", "num_inference_steps": 3, "seed": 1,
                                                                 "webhook": hook},
                                 headers={"Prefer": "respond-async"}, timeout=60)
            assert created.status_code == 202, created.text
            job = created.json()["id"]
            assert wait_until(lambda: calls, 240), "no webhook came"  # bounds a hang only
            done = httpx.get(f"{server.url}/v1/images/jobs/{job}", timeout=30).json()
            events = httpx.get(f"{server.url}/v1/images/jobs/{job}/events", timeout=30).text
    finally:
        receiver.shutdown()
    assert done["status"] == "completed" and decode_png(done["result"]["data"][0]["b64_json"]).size == (512, 512)
    assert calls[0]["type"] == "image.completed" and calls[0]["data"]["id"] == job, calls
    assert "image.completed" in events


def test_the_fake_needs_a_latency_model_file():
    with pytest.raises(StartupError, match="latency-model FILE"):
        with front_of("--model", "fake", "--strategy", "continuous"):
            pass


def test_the_fake_refuses_what_it_cannot_honour(tmp_path):
    with pytest.raises(StartupError, match="--lora-dir cannot apply to it"):
        with front_of(*FAKE, "--lora-dir", str(tmp_path)):
            pass
