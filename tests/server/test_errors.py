"""Every error is an OpenAI-shaped answer with the right status; bad input never gets a 5xx (fuzzed)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import GENERATIONS, assert_error_shape, decode_png

from stepserve.server.schemas import FIELDS, ServerLimits


@pytest.fixture(scope="module")
def server(serve):
    with serve(strategy="continuous", max_batch_size=8, limits=ServerLimits(max_n=4)) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    # Every body here is sent as JSON (a raw body gets no content type from httpx; the server answers 415 to that,
    # see test_a_body_not_declared_json_is_415), so that the body itself is what is checked.
    with httpx.Client(base_url=server.url, timeout=60, headers={"Content-Type": "application/json"}) as client:
        yield client


BAD = [
    (b"{", None), (b"", None), (b"[1, 2]", None), (b'"prompt"', None), (b"\xff\xfe", None),
    (b'{"prompt": "a", "seed": NaN}', None), (b'{"prompt": "a", "seed": Infinity}', None),
    (b"{}", "prompt"), (b'{"prompt": 3}', "prompt"), (b'{"prompt": "   "}', "prompt"),
    (b'{"prompt": "' + b"x" * 5000 + b'"}', "prompt"),
    (b'{"prompt": "a", "n": 0}', "n"), (b'{"prompt": "a", "n": 5}', "n"), (b'{"prompt": "a", "n": "2"}', "n"),
    (b'{"prompt": "a", "n": true}', "n"), (b'{"prompt": "a", "n": 1.5}', "n"),
    (b'{"prompt": "a", "size": "big"}', "size"), (b'{"prompt": "a", "size": "17x16"}', "size"),
    (b'{"prompt": "a", "size": "4096x4096"}', "size"), (b'{"prompt": "a", "size": 16}', "size"),
    (b'{"prompt": "a", "response_format": "url"}', "response_format"),
    (b'{"prompt": "a", "output_format": "jpeg"}', "output_format"),
    (b'{"prompt": "a", "stream": "yes"}', "stream"),
    (b'{"prompt": "a", "stream": true, "partial_images": 4}', "partial_images"),
    (b'{"prompt": "a", "partial_images": 2}', "partial_images"),
    (b'{"prompt": "a", "num_inference_steps": 0}', "num_inference_steps"),
    (b'{"prompt": "a", "num_inference_steps": 100000}', "num_inference_steps"),
    (b'{"prompt": "a", "guidance_scale": -1}', "guidance_scale"),
    (b'{"prompt": "a", "guidance_scale": 1e308}', "guidance_scale"),
    (b'{"prompt": "a", "seed": -1}', "seed"), (b'{"prompt": "a", "seed": 99999999999999999999999}', "seed"),
    (b'{"prompt": "a", "sampler": "plms"}', "sampler"), (b'{"prompt": "a", "negative_prompt": 7}', "negative_prompt"),
    (b'{"prompt": "a", "timeout_s": 0}', "timeout_s"), (b'{"prompt": "a", "timeout_s": "soon"}', "timeout_s"),
    (b'{"prompt": "a", "seeds": 1}', "seeds"), (b'{"prompt": "a", "model": 3}', "model"),
    # text that does not encode as UTF-8 (a lone surrogate) and numbers too large for a float (they parse to inf)
    (b'{"prompt": "\\ud800"}', "prompt"), (b'{"prompt": "a \\udfff b"}', "prompt"),
    (b'{"prompt": "a", "negative_prompt": "\\ud800"}', "negative_prompt"),
    (b'{"prompt": "a", "timeout_s": 1e309}', "timeout_s"), (b'{"prompt": "a", "timeout_s": -1e309}', "timeout_s"),
    (b'{"prompt": "a", "guidance_scale": 1e309}', "guidance_scale"),
    (b'{"prompt": "a", "output_compression": 1e309}', "output_compression"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_input_is_400_naming_the_field(http, body, param):
    error = assert_error_shape(http.post(GENERATIONS, content=body), 400)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_allowed_values_are_named(http):
    message = assert_error_shape(http.post(GENERATIONS, json={"prompt": "a", "sampler": "plms"}), 400)["message"]
    assert "ddim" in message and "euler" in message
    message = assert_error_shape(http.post(GENERATIONS, json={"prompt": "a", "size": "17x16"}), 400)["message"]
    assert "multiples of 4" in message


def test_body_too_large_is_413(http):
    error = assert_error_shape(http.post(GENERATIONS, content=b'{"prompt": "' + b"x" * 70_000 + b'"}'), 413)
    assert "KiB" in error["message"]


def test_unknown_route_and_method(http):
    assert_error_shape(http.get("/v1/nothing"), 404)
    assert_error_shape(http.get(GENERATIONS), 405)
    assert_error_shape(http.get("/v1/models/other"), 404)


def test_deadline_passed_is_504(http):
    error = assert_error_shape(http.post(GENERATIONS, json={"prompt": "a", "num_inference_steps": 200,
                                                             "timeout_s": 0.05}), 504)
    assert error["code"] == "deadline_exceeded" and "timeout" in error["message"]


def test_default_timeout_from_limits(serve):
    with serve(strategy="continuous", limits=ServerLimits(default_timeout_s=0.05)) as s:
        assert_error_shape(httpx.post(s.url + GENERATIONS, json={"prompt": "a", "num_inference_steps": 200},
                                      timeout=240), 504)


class FailOn:
    """Wraps an executor; the denoiser raises for batches that hold a prompt containing 'explode'."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.model_info = inner.model_info

    def prepare(self, requests):
        return self.inner.prepare(requests)

    def denoise(self, requests):
        if any("explode" in r.params.prompt for r in requests):
            raise RuntimeError("simulated device failure")
        return self.inner.denoise(requests)

    def decode(self, requests):
        return self.inner.decode(requests)

    def preview(self, request):
        return self.inner.preview(request)


def test_model_failure_is_500_for_that_request_only(serve, tiny_executor):
    with serve(strategy="none", executor=FailOn(tiny_executor)) as s:
        with httpx.Client(base_url=s.url, timeout=60) as http:
            error = assert_error_shape(http.post(GENERATIONS, json={"prompt": "explode", "num_inference_steps": 2}),
                                       500)
            assert "simulated device failure" in error["message"] and error["code"] == "model_failure"
            ok = http.post(GENERATIONS, json={"prompt": "fine", "num_inference_steps": 2})
            assert ok.status_code == 200 and decode_png(ok.json()["data"][0]["b64_json"])
            assert "stepserve_failed_total 1.0" in http.get("/metrics").text


# --- fuzzing ---------------------------------------------------------------------------------------------------
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False,
                                                                                      allow_infinity=False) | \
    st.text(max_size=12) | st.sampled_from(["16x16", "32x32", "auto", "8x8", "b64_json", "png", "euler", "ddim"])
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
field_names = st.sampled_from([f for f in FIELDS if f != "timeout_s"]) | st.text(max_size=8)
bodies = st.dictionaries(field_names, json_values, max_size=7)


def _check_answer(r: httpx.Response, body) -> None:
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        assert_error_shape(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert "image_generation.completed" in r.text or "event: error" in r.text
    else:
        assert r.json()["data"]


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, steps=st.sampled_from([None, 1, 2]))
def test_fuzz_json_bodies(http, body, steps):
    if steps is not None and "num_inference_steps" not in body:
        body["num_inference_steps"] = steps  # keep the bodies that do generate cheap
    elif "num_inference_steps" not in body:
        body.setdefault("num_inference_steps", 1)
    _check_answer(http.post(GENERATIONS, json=body), body)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200) | st.text(max_size=80).map(str.encode))
def test_fuzz_raw_bodies(http, raw):
    _check_answer(http.post(GENERATIONS, content=raw, headers={"Content-Type": "application/json"}), raw)


def test_an_unexpected_error_is_a_500_counted_in_the_requests(monkeypatch):
    """An image request that fails on something no handler expected is answered 500 (OpenAI-shaped) and counted
    in stepserve_requests_total{outcome="failed"}, as a video's is."""
    from fastapi.testclient import TestClient

    import stepserve.server.app as app_module
    import stepserve.server.images as images_module
    from stepserve.costs import FakeExecutor
    from stepserve.engine.async_engine import AsyncEngine

    def broken_encoder(image):
        raise RuntimeError("the PNG encoder broke")

    monkeypatch.setattr(images_module, "encode", broken_encoder)
    app = app_module.create_app(AsyncEngine(FakeExecutor(), strategy="continuous"))
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post(GENERATIONS, json={"prompt": "a", "num_inference_steps": 2})
        metrics = client.get("/metrics").text
    assert assert_error_shape(answer, 500)["code"] == "internal_error"
    counted = [line for line in metrics.splitlines() if line.startswith('stepserve_requests_total{outcome="failed"} ')]
    assert counted == ['stepserve_requests_total{outcome="failed"} 1.0'], metrics
