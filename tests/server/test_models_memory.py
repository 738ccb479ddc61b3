"""Three tiny SD models over --device-memory-mb (room for two): the idle least recently used model moves to host
memory when another needs the device, and moves back for its next request, whose image equals diffusers' own;
host memory over --host-memory-mb sends a model back to disk, and its next request loads it again (and equals its
reference); a request whose deadline is shorter than that load is refused at once with 429 and Retry-After."""

import httpx
import numpy as np
import pytest
from family_reference import reference_image
from several_models import body_of, front_of, image_of
from tiny_sd import build_tiny_sd

from stepserve import SamplingParams

P = SamplingParams(prompt="a red fox", seed=7, num_inference_steps=3, guidance_scale=4.5, sampler="euler",
                   height=16, width=16)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    root = tmp_path_factory.mktemp("three")
    return {name: build_tiny_sd(root / name, seed=seed) for name, seed in (("a", 0), ("b", 1), ("c", 2))}


def places(client) -> dict:
    return {m["id"]: m["place"] for m in client.get("/v1/models").json()["data"]}


def test_idle_models_move_to_host_memory_and_back_by_use(three):
    flags = [f for name, path in three.items() for f in ("--model", f"{name}={path}")]
    with front_of(*flags, "--device-memory-mb", "10", "--strategy", "continuous") as (server, front):
        with httpx.Client(base_url=server.url, timeout=300) as client:
            assert places(client) == {"a": "host", "b": "device", "c": "device"}  # c's load moved a out
            first = client.post("/v1/images/generations", json=body_of("a", P))
            after_a = places(client)
            second = client.post("/v1/images/generations", json=body_of("b", P))
            cards = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
            metrics = client.get("/metrics").text
    assert first.status_code == 200 and second.status_code == 200
    assert after_a == {"a": "device", "b": "host", "c": "device"}  # b was the least recently used
    assert cards["a"]["memory"]["moves"] == {"device": 1, "host": 1} and cards["a"]["memory"]["move_s"]["device"] >= 0
    assert cards["c"]["place"] == "host"  # b came back; c, idle since its load, made room
    assert 'stepserve_model_moves_total{model="a",place="host"} 1' in metrics
    for name, answer in (("a", first), ("b", second)):
        diff = np.abs(image_of(answer.json()) - reference_image("sd", three[name], P))
        assert diff.max() <= 1, (name, diff.max())


def test_host_memory_over_budget_sends_a_model_to_disk_and_its_next_request_loads_it(three):
    flags = [f for name, path in three.items() for f in ("--model", f"{name}={path}")]
    with front_of(*flags, "--device-memory-mb", "5", "--host-memory-mb", "5", "--strategy", "continuous") as (
            server, front):
        entry = front.models.entries["a"]
        with httpx.Client(base_url=server.url, timeout=300) as client:
            assert places(client) == {"a": "disk", "b": "host", "c": "device"}
            assert entry.loads == 1 and entry.engine is None  # loaded once at start-up, then dropped
            late = client.post("/v1/images/generations", json={**body_of("a", P), "timeout_s": 0.0001})
            answer = client.post("/v1/images/generations", json=body_of("a", P))
            after = places(client)
    assert late.status_code == 429 and late.json()["error"]["code"] == "model_loading"
    assert int(late.headers["retry-after"]) >= 1
    assert answer.status_code == 200, answer.text
    assert entry.loads == 2 and after["a"] == "device"
    diff = np.abs(image_of(answer.json()) - reference_image("sd", three["a"], P))
    assert diff.max() <= 1


def test_a_job_of_a_model_gone_to_disk_is_still_found(three):
    """A job's route finds the model the job belongs to (by its service in the state store) and loads it again."""
    import time

    flags = [f for name, path in three.items() for f in ("--model", f"{name}={path}")]
    with front_of(*flags, "--device-memory-mb", "5", "--host-memory-mb", "5", "--strategy", "continuous") as (
            server, front):
        with httpx.Client(base_url=server.url, timeout=300) as client:
            job = client.post("/v1/images/generations", json=body_of("c", P),
                              headers={"Prefer": "respond-async"}).json()["id"]
            deadline = time.monotonic() + 300  # bounds a hang only
            while client.get(f"/v1/images/jobs/{job}").json()["status"] != "completed":
                assert time.monotonic() < deadline
                time.sleep(0.05)  # the job tells its status only when asked
            for name in ("a", "b"):
                assert client.post("/v1/images/generations", json=body_of(name, P)).status_code == 200
            gone = places(client)["c"]
            answer = client.get(f"/v1/images/jobs/{job}")
    assert gone == "disk"
    assert answer.status_code == 200 and answer.json()["status"] == "completed"
    assert front.models.entries["c"].loads == 2
