"""The official openai client works unchanged against the server: images, seeds, fan-out, streaming, auth."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from server_helpers import GENERATIONS, assert_close, assert_error_shape, decode_png, pixels

FAST = {"num_inference_steps": 3, "guidance_scale": 1.0}


@pytest.fixture(scope="module")
def server(serve):
    with serve(strategy="continuous", max_batch_size=8) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_png_of_requested_size_with_extension_fields(client):
    r = client.images.generate(model="pipe", prompt="a red fox", n=1, size="32x32", response_format="b64_json",
                               extra_body={"seed": 1, "num_inference_steps": 3, "guidance_scale": 2.0,
                                           "sampler": "euler", "negative_prompt": "blur", "timeout_s": 60})
    image = decode_png(r.data[0].b64_json)
    assert image.size == (32, 32)
    info = r.model_extra["stepserve"]["images"][0]
    assert info["seed"] == 1 and info["steps"] == 3 and info["sampler"] == "euler"
    assert set(info) >= {"queue_s", "denoise_s", "decode_s", "batch_sizes"} and len(info["batch_sizes"]) == 3


def test_png_of_model_size_without_extension_fields(client):
    r = client.images.generate(prompt="a red fox")  # the model's defaults: its size, steps, sampler, a random seed
    assert decode_png(r.data[0].b64_json).size == (16, 16)
    info = r.model_extra["stepserve"]["images"][0]
    assert isinstance(info["seed"], int) and info["steps"] == 25


def test_seeds_fan_out_and_repeat(client):
    pair = client.images.generate(prompt="seven", n=2, response_format="b64_json", extra_body={"seed": 5, **FAST})
    a, b = (decode_png(d.b64_json) for d in pair.data)
    assert [i["seed"] for i in pair.model_extra["stepserve"]["images"]] == [5, 6]
    diff = np.abs(pixels(a) - pixels(b))
    # another seed gives another image, not one that differs in a few pixels (seeds differ by ~45/255 on average)
    assert diff.mean() > 10 and (diff > 8).mean() > 0.5, (diff.mean(), (diff > 8).mean())
    again = client.images.generate(prompt="seven", extra_body={"seed": 6, **FAST})
    assert_close(decode_png(again.data[0].b64_json), b, tol=0)  # same seed -> same image
    drawn = client.images.generate(prompt="seven", n=2, extra_body=FAST).model_extra["stepserve"]["images"]
    assert drawn[1]["seed"] == drawn[0]["seed"] + 1


def test_streaming_partial_images_then_completed(client):
    stream = client.images.generate(prompt="seven", stream=True, partial_images=2, size="16x16",
                                    extra_body={"seed": 9, "num_inference_steps": 6, "guidance_scale": 1.0})
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(e.size == "16x16" and e.output_format == "png" and e.created_at > 0 for e in events)
    for e in events[:2]:
        assert decode_png(e.b64_json).size == (16, 16)
    plain = client.images.generate(prompt="seven", extra_body={"seed": 9, "num_inference_steps": 6,
                                                               "guidance_scale": 1.0})
    assert_close(decode_png(events[-1].b64_json), decode_png(plain.data[0].b64_json), tol=0)


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list()] == ["pipe"]
    assert client.models.retrieve("pipe").id == "pipe"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "pipe"
    text = httpx.get(server.url + "/metrics").text
    for name in ("stepserve_queue_depth", "stepserve_running_batch_size", "stepserve_step_latency_seconds_bucket",
                 "stepserve_request_latency_seconds_bucket", "stepserve_rejected_total", "stepserve_cancelled_total",
                 "stepserve_failed_total", "stepserve_timed_out_total", "stepserve_images_completed_total"):
        assert name in text, name
    assert 'stepserve_requests_total{outcome="completed"}' in text


def test_url_response_format_is_refused_with_reason(server):
    r = httpx.post(server.url + GENERATIONS, json={"prompt": "x", "response_format": "url"})
    error = assert_error_shape(r, 400)
    assert error["param"] == "response_format" and "b64_json" in error["message"]


def test_api_key(serve):
    with serve(api_key="sekrit", strategy="continuous") as s:
        assert httpx.get(s.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert_error_shape(httpx.get(s.url + path), 401)
            assert_error_shape(httpx.get(s.url + path, headers={"Authorization": "Bearer wrong"}), 401)
        assert_error_shape(httpx.post(s.url + GENERATIONS, json={"prompt": "x"}), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        r = good.images.generate(prompt="x", extra_body={"seed": 1, "num_inference_steps": 1})
        assert decode_png(r.data[0].b64_json).size == (16, 16)
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_the_adaptive_cap_and_step_curve_are_on_metrics(serve):
    with serve(strategy="adaptive", max_batch_size=4) as server:
        for n in (1, 3, 2):  # steps of different sizes: the curve's two parts can be told apart
            r = httpx.post(server.url + GENERATIONS, json={"prompt": "x", "n": n, "seed": n, **FAST}, timeout=60)
            assert r.status_code == 200, r.text
        text = httpx.get(server.url + "/metrics").text
    caps = [line for line in text.splitlines() if line.startswith("stepserve_batch_cap{")]
    assert caps and all(1 <= float(line.rsplit(" ", 1)[1]) <= 4 for line in caps), caps
    assert 'part="fixed"' in text and 'part="per_request"' in text


def test_the_slo_policys_profile_scale_is_on_metrics(serve):
    """The default policy predicts with its profile corrected by the steps it observes: the correction is shown."""
    with serve(strategy="slo", max_batch_size=4) as server:
        r = httpx.post(server.url + GENERATIONS, json={"prompt": "x", "n": 2, "seed": 1, **FAST}, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.get(server.url + "/metrics").text
    scales = [line for line in text.splitlines() if line.startswith("stepserve_profile_scale{")]
    assert scales and all(float(line.rsplit(" ", 1)[1]) > 0 for line in scales), scales
