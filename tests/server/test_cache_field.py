"""The HTTP `cache` field: a request caches steps when it asks, its answer says how many steps reused cached
work; a bad value is a 400 naming the field; the server's --cache is the default a request may turn off; a
default the model cannot run stops start-up with a message."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.server.app import create_app


def client_for(cache=None) -> TestClient:
    built = build_engine(EngineConfig(model="embedded", cache=cache, memory_cap=False, warm_up=False,
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    return TestClient(create_app(AsyncEngine(built.executor, options=built.options)))


def image_info(client, **body) -> dict:
    answer = client.post("/v1/images/generations", json={"prompt": "seven", "seed": 3, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()["stepserve"]["images"][0]


def test_a_request_caches_when_it_asks():
    with client_for() as client:
        plain = image_info(client, num_inference_steps=12)
        cached = image_info(client, num_inference_steps=12, cache={"policy": "deepcache", "interval": 3})
    assert plain["cache"] is None and plain["cached_steps"] == 0
    assert cached["cache"] == {"policy": "deepcache", "interval": 3} and cached["cached_steps"] == 8


def test_bad_cache_value_is_a_400_naming_the_field():
    with client_for() as client:
        answer = client.post("/v1/images/generations", json={"prompt": "seven", "cache": {"policy": "magcache"}})
    assert answer.status_code == 400
    assert "cache" in answer.text and "allowed here: fbcache, deepcache" in answer.text


def test_server_default_applies_and_a_request_may_turn_it_off():
    with client_for(cache={"policy": "deepcache", "interval": 2}) as client:
        default = image_info(client, num_inference_steps=10)
        off = image_info(client, num_inference_steps=10, cache="off")
    assert default["cached_steps"] == 5 and default["cache"]["policy"] == "deepcache"
    assert off["cached_steps"] == 0 and off["cache"] is None


def test_a_default_the_model_cannot_run_stops_start_up():
    with pytest.raises(ValueError, match="cache: policy 'magcache' does not run on embedded"):
        client_for(cache="magcache")
