"""docs/HTTP_API.md's answer example is what the server answers: the same fields, and the embedded model's own
defaults for the request it names."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fastapi.testclient import TestClient

DOC = Path(__file__).resolve().parents[2] / "docs" / "HTTP_API.md"
TIMES = ("created", "request_id", "queue_s", "denoise_s", "decode_s", "total_s", "batch_sizes")  # vary per run


def documented_answer() -> dict:
    text = DOC.read_text().split("### Answer", 1)[1]
    block = re.search(r"```json\n(.*?)\n```", text, re.S).group(1)
    return json.loads(block)


def test_the_documented_answer_is_the_servers():
    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.engine.loading import load_executor
    from stepserve.server.app import create_app

    doc = documented_answer()
    with TestClient(create_app(AsyncEngine(load_executor("embedded")))) as client:
        real = client.post("/v1/images/generations", json={"prompt": "seven", "seed": 42}).json()
    assert set(doc) == set(real) and set(doc["stepserve"]) == set(real["stepserve"])
    doc_image, real_image = doc["stepserve"]["images"][0], real["stepserve"]["images"][0]
    assert set(doc_image) == set(real_image)
    for key in doc_image:
        if key not in TIMES:
            assert doc_image[key] == real_image[key], key
    assert len(doc_image["batch_sizes"]) == len(real_image["batch_sizes"]) == real_image["num_inference_steps"]
    assert (doc["size"], doc["output_format"], doc["stepserve"]["model"]) == (
        real["size"], real["output_format"], real["stepserve"]["model"])
