"""Schema-driven fuzzing of a live server: bodies built from the served /openapi.json (each field of its declared
type, or of any other JSON type), unicode edge cases, huge and non-finite numbers, raw bytes and wrong content
types. Every answer must be a well-shaped error or a 200: never a 5xx other than a 504 (a deadline a request set
itself), never a hang; and healthy requests sent alongside all get their 200.

CI runs FUZZ_CI_REQUESTS examples; `STEPSERVE_SLOW=1` (or `-m slow`) also runs the long version.

Lone UTF-16 surrogates (`"\\ud800"` in a prompt) are among the bodies: validation refuses them with a 400 (before
it did, such a prompt failed its whole batch).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import GENERATIONS, ServerThread

from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app
from stepserve.server.schemas import ServerLimits

FUZZ_CI_REQUESTS = 250
FUZZ_LONG_REQUESTS = 2500
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", None, "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "*/*", "application/jsonx"]
EDGE_TEXT = ["", " ", "\x00", "\u202e\u202d", "\ufeff", "e\u0301" * 50, "\U0001f98a" * 700, "a" * 5000, "\n\t\r",
             "\ud800", "a\udfffb", "\U0010ffff", "\\u0000", "null", "0x10", "512x512", "16x16", "9" * 400 + "x16"]
EDGE_NUMBERS = [0, -1, 1, 2, 10**30, -(10**30), 2**63, 2**64, 1e308, -1e308, 5e-324, 0.5, 1.5, float("inf"),
                float("-inf"), float("nan")]
RAW = [b"", b"{", b"[]", b"null", b"\xff\xfe\x00", b'{"prompt": "a", "timeout_s": 1e309}',
       b'{"prompt": "a", "guidance_scale": -1e309}', b'{"prompt": "a", "seed": 1e999}', b'{"prompt": "a",}',
       b'{"prompt": "a", "prompt": 3}', b"[" * 5000 + b"]" * 5000, b'{"prompt": "\\ud800"}',
       b'{"prompt": "a", "negative_prompt": "\\udc00"}', b'{"prompt": "a", "n": 1.0}', b'{"prompt": "a"}' * 2]

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=10)
edge_text = st.sampled_from(EDGE_TEXT) | st.text(max_size=80) | st.text(
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.characters(), max_size=12)
edge_number = st.sampled_from(EDGE_NUMBERS) | st.floats(allow_nan=True, allow_infinity=True)
edge_integer = st.sampled_from([n for n in EDGE_NUMBERS if isinstance(n, int)]) | st.integers(-(2**70), 2**70)
BY_TYPE = {"string": edge_text, "integer": edge_integer, "number": edge_number | edge_integer,
           "boolean": st.booleans(), "null": st.none()}


def field_values(schema: dict) -> st.SearchStrategy:
    """A value of one of the field's declared types (the edge cases of each), or any JSON value at all."""
    types = [s.get("type") for s in schema.get("anyOf", [schema])]
    declared = st.one_of(*(BY_TYPE[t] for t in types if t in BY_TYPE))
    return st.one_of(declared, declared, declared, json_values)


def bodies(schema: dict) -> st.SearchStrategy:
    """JSON bodies from the request schema: the required fields mostly present, optional ones sometimes, an
    unknown field now and then; or a raw body."""
    props = schema["properties"]
    fields = st.fixed_dictionaries({}, optional={name: field_values(s) for name, s in props.items()})
    required = st.fixed_dictionaries({name: field_values(props[name]) for name in schema.get("required", [])})
    extra = st.dictionaries(st.text(min_size=1, max_size=12), json_values, max_size=1)
    objects = st.tuples(required, fields, extra).map(lambda parts: {**parts[2], **parts[1], **parts[0]})
    encoded = objects.map(lambda body: json.dumps(body, allow_nan=True).encode())
    return st.one_of(encoded, encoded, encoded, encoded, st.sampled_from(RAW), st.binary(max_size=200))


class Healthy(threading.Thread):
    """Small, valid requests, one after another, for as long as the fuzzing runs; every one must get a 200. Each has
    a deadline of its own far past what a busy machine needs (the server's default one is short, for the fuzz)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.codes = url, threading.Event(), []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=240) as http:
            i = 0
            while not self.stop.is_set():
                r = http.post(GENERATIONS, json={"prompt": "healthy", "num_inference_steps": 2, "seed": i,
                                                   "timeout_s": 240})
                self.codes.append(r.status_code)
                i += 1
                time.sleep(0.02)


@pytest.fixture(scope="module")
def live(tiny_executor):
    # --max-queue off on purpose: the fuzzing must never crowd the healthy requests out with a 429; the deadline of
    # a request without its own timeout_s is short, so a slow valid body cannot hold the test up
    app = create_app(AsyncEngine(tiny_executor, max_batch_size=4), limits=ServerLimits(max_n=2, default_timeout_s=10))
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        schema = http.get("/openapi.json").json()
        body = schema["paths"][GENERATIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]
        yield http, body, server.url


def test_lone_surrogates_are_refused_alone(live):
    http = live[0]
    r = http.post(GENERATIONS, content=b'{"prompt": "\\ud800", "num_inference_steps": 1}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def fuzz(live, examples: int) -> dict:
    http, schema, url = live
    tally: dict[int, int] = {}
    healthy = Healthy(url)
    healthy.start()
    started = time.monotonic()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(schema), content_type=st.sampled_from(CONTENT_TYPES), model_id=st.none() | edge_text)
    def one(body: bytes, content_type: str | None, model_id: str | None) -> None:
        if model_id is not None and len(tally) % 10 == 0:  # now and then the other route with a parameter
            r = http.get("/v1/models/" + model_id.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))
        else:
            r = http.post(GENERATIONS, content=body, headers={"Content-Type": content_type} if content_type else {})
        tally[r.status_code] = tally.get(r.status_code, 0) + 1
        assert r.status_code < 500 or r.status_code == 504, (r.status_code, body[:200], content_type, r.text[:300])
        if r.status_code >= 400:
            assert set(r.json()) == {"error"}, r.text[:300]

    try:
        one()
    finally:
        healthy.stop.set()
        healthy.join(240)
    took = time.monotonic() - started
    assert not healthy.is_alive(), "a healthy request hung"
    assert healthy.codes and set(healthy.codes) == {200}, healthy.codes
    report = {"requests": sum(tally.values()), "by_status": dict(sorted(tally.items())), "healthy": len(healthy.codes),
              "seconds": round(took, 1)}
    print(f"fuzz: {report}")
    return report


def test_fuzz_the_live_server_from_its_schema(live):
    report = fuzz(live, FUZZ_CI_REQUESTS)
    assert report["requests"] >= FUZZ_CI_REQUESTS * 0.9, report


@pytest.mark.slow
def test_fuzz_the_live_server_long(live):
    report = fuzz(live, FUZZ_LONG_REQUESTS)
    assert report["requests"] >= 2000, report
