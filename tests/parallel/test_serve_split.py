"""`stepserve serve --ulysses-degree 2` end to end over HTTP: healthy, each image equals the one-process image, a
size whose tokens do not split is a 400 naming it, and SIGTERM stops every worker."""

from __future__ import annotations

import base64
import io
import signal
import threading

import httpx
import numpy as np
import pytest
from PIL import Image
from rank_servers import HANG_S, RankServer, tiny_flux, wait_gone

from stepserve.api import Engine
from stepserve.request.types import SamplingParams

GENERATIONS = "/v1/images/generations"
REQUESTS = [dict(prompt="a red cat", width=32, height=32, num_inference_steps=3, seed=1, guidance_scale=3.0),
            dict(prompt="a dog on a hill", width=64, height=48, num_inference_steps=4, seed=2, guidance_scale=5.0),
            dict(prompt="a boat", width=32, height=32, num_inference_steps=2, seed=3, guidance_scale=1.0)]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tiny_flux(tmp_path_factory)


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


@pytest.mark.slow  # a server of two ranks, and the model once more in this process
def test_ulysses_2_over_http_equals_one_process_refuses_sizes_that_do_not_split_and_stops_every_worker(flux):
    server = RankServer(flux, "--ulysses-degree", "2")
    engine = Engine.from_pretrained(str(flux), memory_cap=False, strategy="continuous")
    alone = [np.asarray(r.image.convert("RGB"), dtype=np.int16)
             for r in engine.generate([SamplingParams(**r) for r in REQUESTS])]
    server.start()
    try:
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
        workers = server.workers()
        assert len(workers) == 1
        answers: dict[int, httpx.Response] = {}

        def post(i: int, r: dict) -> None:
            body = {"prompt": r["prompt"], "size": f"{r['width']}x{r['height']}", "seed": r["seed"],
                    "num_inference_steps": r["num_inference_steps"], "guidance_scale": r["guidance_scale"],
                    "response_format": "b64_json"}
            answers[i] = httpx.post(server.url + GENERATIONS, json=body, timeout=HANG_S)

        threads = [threading.Thread(target=post, args=(i, r)) for i, r in enumerate(REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
        for i, ref in enumerate(alone):
            assert answers[i].status_code == 200, answers[i].text
            diff = np.abs(pixels(answers[i].json()["data"][0]["b64_json"]) - ref).max()
            assert diff <= 1, (REQUESTS[i], diff)
        odd = httpx.post(server.url + GENERATIONS, json={"prompt": "x", "size": "20x20"}, timeout=HANG_S)
        assert odd.status_code == 400, odd.text
        message = odd.json()["error"]["message"]
        assert "20x20" in message and "25 image tokens do not split over the 2 ranks" in message, message
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        assert server.stop(signal.SIGTERM) == 0, "".join(server.lines[-20:])
        assert wait_gone(workers), workers
    finally:
        server.stop(signal.SIGKILL)
