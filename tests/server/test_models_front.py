"""The front of a server of several models (server/dispatch.py) against bad and unauthenticated requests, and
loads that are slow or fail: the key is checked before any body is read or any model loads, a body is parsed as
the models' apps parse it, a load never outlives the request's deadline, and a load that failed is not retried on
every request."""

import shutil
import threading

import httpx
import pytest
from several_models import front_of

KEY = {"Authorization": "Bearer k"}


@pytest.fixture
def two_lazy(tiny_sd_path, tmp_path):
    for name in ("one", "two"):
        shutil.copytree(tiny_sd_path, tmp_path / name)
    return tmp_path


def test_no_key_no_load_and_no_model_names(two_lazy):
    with front_of("--models-dir", str(two_lazy), "--api-key", "k", "--strategy", "continuous") as (server, front):
        with httpx.Client(base_url=server.url, timeout=300) as client:
            anything = client.get("/v1/loras")
            generation = client.post("/v1/images/generations", json={"model": "two", "prompt": "x"})
            preflight = client.options("/v1/images/generations")
            health = client.get("/health").json()
            with_key = client.get("/health", headers=KEY).json()
            unknown = client.get("/v1/loras?model=nope")
        loads = {e.name: e.loads for e in front.models.entries.values()}
    assert anything.status_code == 401 and generation.status_code == 401 and unknown.status_code == 401
    assert preflight.status_code == 503 and preflight.json()["error"]["code"] == "no_model_loaded"
    assert loads == {"one": 0, "two": 0}  # nothing loaded for a caller without the key
    assert "models" not in health and set(with_key["models"]) == {"one", "two"}


@pytest.mark.parametrize("body,status,says", [
    ("[" * 10_000 + "]" * 10_000, 400, ""),  # nested too deeply for the parser: the model's app says so
    ('{"model": ["one"], "prompt": "x"}', 400, "model: expected a string"),
    ('{"model": "nope", "prompt": "x"}', 404, "served: one, two"),
])
def test_bad_bodies_are_4xx_never_500(tiny_sd_path, tmp_path, body, status, says):
    flags = [f for name in ("one", "two") for f in ("--model", f"{name}={tiny_sd_path}")]
    with front_of(*flags, "--strategy", "continuous") as (server, front):
        answer = httpx.post(server.url + "/v1/images/generations", content=body,
                            headers={"content-type": "application/json"}, timeout=300)
    assert answer.status_code == status and says in answer.text, answer.text


def test_a_body_declared_too_large_is_refused_before_it_is_read(tiny_sd_path):
    flags = [f for name in ("one", "two") for f in ("--model", f"{name}={tiny_sd_path}")]
    with front_of(*flags, "--strategy", "continuous") as (server, front):
        limit = front.dispatch.body_limit
        answer = httpx.post(server.url + "/v1/images/generations", content=b"{" + b" " * limit + b"}",
                            headers={"content-type": "application/json"}, timeout=300)
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "body_too_large"


def test_a_load_longer_than_the_deadline_is_a_504_and_the_load_goes_on(two_lazy):
    with front_of("--models-dir", str(two_lazy), "--strategy", "continuous") as (server, front):
        models, release = front.models, threading.Event()
        load = models.load_now
        models.load_now = lambda entry: (release.wait(300), load(entry))[1]  # held until the test lets it go
        with httpx.Client(base_url=server.url, timeout=300) as client:
            late = client.post("/v1/images/generations", json={"model": "one", "prompt": "x", "timeout_s": 0.2})
            release.set()
            after = client.post("/v1/images/generations", json={"model": "one", "prompt": "x",
                                                                "num_inference_steps": 2})
    assert late.status_code == 504 and "did not load within" in late.json()["error"]["message"]
    assert after.status_code == 200 and models.entries["one"].loads == 1  # the one load served both


def test_a_load_that_fails_answers_503_and_is_not_tried_again_at_once(two_lazy):
    shutil.rmtree(two_lazy / "two" / "unet")  # its weights are gone: the load fails
    with front_of("--models-dir", str(two_lazy), "--strategy", "continuous") as (server, front):
        tries = []
        load = front.models.load_now
        front.models.load_now = lambda entry: (tries.append(entry.name), load(entry))[1]
        with httpx.Client(base_url=server.url, timeout=300) as client:
            first = client.post("/v1/images/generations", json={"model": "two", "prompt": "x"})
            second = client.post("/v1/images/generations", json={"model": "two", "prompt": "x"})
            other = client.post("/v1/images/generations", json={"model": "one", "prompt": "x",
                                                                "num_inference_steps": 2})
    for answer in (first, second):
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_load_failed"
        assert int(answer.headers["retry-after"]) >= 1
    assert tries == ["two", "one"] and other.status_code == 200
