"""The HTTP surface: JSON-only POSTs (415), an opt-in CORS allow-list, the OpenAPI schema behind the key, refused
scrapes counted apart from image requests, and a replica's unexpected 500 that keeps its header and message."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from server_helpers import GENERATIONS, ServerThread, assert_error_shape

from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import REPLICA_HEADER, create_app

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def tiny_server(tiny_executor):
    @contextlib.contextmanager
    def start(**app_options):
        """The real app over the tiny model, served by uvicorn on a free port."""
        with ServerThread(create_app(AsyncEngine(tiny_executor, max_batch_size=4), **app_options)) as server:
            yield server

    return start


@pytest.fixture(scope="module")
def keyed(tiny_server):
    with tiny_server(api_key=KEY) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx"])
def test_a_body_not_declared_json_is_415(keyed, content_type):
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    r = keyed.post(GENERATIONS, content=b'{"prompt": "a", "num_inference_steps": 1}', headers=headers)
    error = assert_error_shape(r, 415)
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]


def test_json_with_a_charset_is_accepted(keyed):
    r = keyed.post(GENERATIONS, content=b'{"prompt": "a", "num_inference_steps": 1}',
                   headers={**AUTH, "Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


def test_openapi_schema_is_served_behind_the_key(keyed):
    assert_error_shape(keyed.get("/openapi.json"), 401)
    schema = keyed.get("/openapi.json", headers=AUTH).json()
    body = schema["paths"][GENERATIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["prompt"] and body["additionalProperties"] is False
    assert {"prompt", "n", "size", "timeout_s", "guidance_scale"} <= set(body["properties"])
    assert "/openapi.json" not in schema["paths"]


def test_refused_scrapes_have_their_own_counter(keyed):
    before = keyed.get("/metrics", headers=AUTH).text
    for _ in range(3):
        assert_error_shape(keyed.get("/metrics"), 401)
    assert_error_shape(keyed.get("/metrics", headers={"Authorization": "Bearer wrong"}), 401)
    assert_error_shape(keyed.post(GENERATIONS, json={"prompt": "a"}), 401)
    after = keyed.get("/metrics", headers=AUTH).text

    def sample(text: str, name: str) -> float:
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))

    scrapes = 'stepserve_unauthorized_calls_total{route="metrics"}'
    images = 'stepserve_requests_total{outcome="unauthorized"}'
    assert sample(after, scrapes) - sample(before, scrapes) == 4
    assert sample(after, images) - sample(before, images) == 1  # only the image request

    assert_error_shape(keyed.post("/v1/images/edits", data={"prompt": "a"}), 401)  # an image request too
    assert_error_shape(keyed.post("/v1/videos", json={"prompt": "a"}), 401)  # a video's creation
    assert_error_shape(keyed.get("/v1/videos/video_x"), 401)  # a look-up
    assert_error_shape(keyed.get("/v1/engine/events"), 401)  # the console's event stream
    last = keyed.get("/metrics", headers=AUTH).text
    assert sample(last, images) - sample(after, images) == 1
    video = 'stepserve_video_jobs_total{outcome="unauthorized"}'
    assert sample(last, video) - sample(after, video) == 1
    for route in ("videos", "events"):
        name = f'stepserve_unauthorized_calls_total{{route="{route}"}}'
        assert sample(last, name) - sample(after, name) == 1


def test_cors_is_off_by_default(keyed):
    r = keyed.options(GENERATIONS, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    r = keyed.get("/health", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in r.headers


def test_cors_allow_list_lets_its_origins_through_and_no_other(tiny_server):
    with tiny_server(cors_origins=[ORIGIN]) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        ok = http.options(GENERATIONS, headers={"Origin": ORIGIN, **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        other = http.options(GENERATIONS, headers={"Origin": "https://evil.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = http.post(GENERATIONS, json={"prompt": "a", "num_inference_steps": 1}, headers={"Origin": ORIGIN})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_an_unexpected_500_in_a_replica_keeps_its_header_and_message_through_the_proxy(monkeypatch, tiny_executor):
    from stepserve.server.ray.proxy_errors import OpenAIErrorsFromRay

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr("stepserve.server.app.engine_params", broken)
    app = create_app(AsyncEngine(tiny_executor, max_batch_size=4), replica="replica-7")
    for served in (app, OpenAIErrorsFromRay(app)):  # the replica alone, then behind Ray's proxy middleware
        served.state = app.state  # ServerThread reads the engine from app.state
        with ServerThread(served) as server:
            r = httpx.post(server.url + GENERATIONS, json={"prompt": "a"}, timeout=30)
        error = assert_error_shape(r, 500)
        assert r.headers[REPLICA_HEADER] == "replica-7"
        assert error["code"] == "internal_error" and error["message"] == "internal error: KeyError", error
