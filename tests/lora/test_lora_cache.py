"""The adapter cache: a folder's adapters are servable by name, loaded on first use within a memory budget, the
least recently used idle one unloaded to make room (and loaded again when named); an adapter requests carry is
never unloaded for room; files are read before the executor's lock is taken, so a load stalls a running step
by the injection alone."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from stepserve import Engine, SamplingParams
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.lora.errors import LoraError
from stepserve.server.app import create_app
from stepserve.tiny.lora import build_tiny_lora

from extras import require

# one rank-4 adapter on the embedded model's 24 attention projections: its weights (49152 bytes), and its slots in
# the per-layer stacks of mixed batches (as much again, and one scale per layer), all counted in the budget
RANK4_BYTES = 2 * 49152 + 24 * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    require("peft", "lora")
    root = tmp_path_factory.mktemp("lora_cache")
    for i, name in enumerate(["ink", "chalk", "oil"]):
        build_tiny_lora("embedded", root / f"{name}.safetensors", seed=i, rank=4, std=0.3)
    return root


def test_first_use_loads_and_the_least_recently_used_idle_one_makes_room(folder):
    budget_mb = 2.5 * RANK4_BYTES / 2**20  # room for two
    built = build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=str(folder),
                                      lora_memory_mb=budget_mb, options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    store = built.executor.adapters()
    assert sorted(store.adapters) == ["chalk", "ink"] and store.names == {"chalk", "ink", "oil"}
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        def make(name):
            answer = client.post("/v1/images/generations", json={"prompt": "seven", "seed": 4, "num_inference_steps": 4,
                                                                  "loras": [{"name": name}]})
            assert answer.status_code == 200, answer.text
            return answer.json()["data"][0]["b64_json"]

        make("chalk")  # ink is now the least recently used
        oil = make("oil")  # loaded on first use; ink unloaded for room
        assert sorted(store.adapters) == ["chalk", "oil"] and store.evictions == 1
        listed = client.get("/v1/loras").json()["data"]  # every servable adapter, and where it is loaded now
        assert [a["name"] for a in listed] == ["chalk", "ink", "oil"]
        here = client.app.state.lora_registry.replica
        assert [a["name"] for a in listed if here in a["replicas"]] == ["chalk", "oil"]
        assert [a["rank"] for a in listed] == [4, None, 4]  # details where a replica holds it loaded
        make("ink")  # back again: chalk goes
        assert sorted(store.adapters) == ["ink", "oil"]
        assert make("oil") == oil  # the same image after all that loading and unloading


def test_an_adapter_requests_carry_is_never_unloaded_for_room(folder):
    engine = Engine.from_pretrained("embedded", strategy="continuous")
    store = engine.executor.adapters(folder, budget_bytes=int(2.5 * RANK4_BYTES))
    store.ensure(["ink", "chalk"])
    with pytest.raises(LoraError, match="does not fit the adapter memory"):
        store.ensure(["oil"], in_use={"ink", "chalk"})
    assert sorted(store.adapters) == ["chalk", "ink"]


def test_an_adapter_over_the_whole_budget_is_a_400_never_a_429_to_retry(folder):
    built = build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=str(folder),
                                      lora_memory_mb=0.01, options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        answer = client.post("/v1/images/generations", json={"prompt": "seven", "loras": [{"name": "ink"}]})
    assert answer.status_code in (400, 413) and "larger than the whole adapter memory" in answer.text
    assert "retry-after" not in answer.headers
    assert answer.json()["error"]["code"] == "addon_too_large"  # as a ControlNet's or an IP-Adapter's


def test_a_held_adapter_memory_is_the_add_ons_429(folder, monkeypatch):
    """The adapter gate's 'retry later' answers as every add-on kind's does (addon_memory_full, Retry-After), not
    as a full queue."""
    from stepserve.lora.errors import LoraBudgetError

    built = build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=str(folder),
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    engine = AsyncEngine(built.executor, options=built.options)

    def held(group, wait):
        raise LoraBudgetError("adapter 'ink' does not fit the adapter memory beside those in use; retry later")

    monkeypatch.setattr(engine.adapter_gate, "admitting", held)
    with TestClient(create_app(engine)) as client:
        answer = client.post("/v1/images/generations", json={"prompt": "seven", "loras": [{"name": "ink"}]})
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "addon_memory_full", answer.text
    assert answer.headers["retry-after"]


def test_the_file_is_read_before_the_executors_lock_is_taken(folder, monkeypatch):
    engine = Engine.from_pretrained("embedded", strategy="continuous")
    store = engine.executor.adapters(folder)
    events = []

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            events.append("lock")
            return self.inner.__enter__()

        def __exit__(self, *exc):
            events.append("unlock")
            return self.inner.__exit__(*exc)

    read = store.injector.read
    monkeypatch.setattr(store.injector, "read", lambda file: (events.append("read"), read(file))[1])
    monkeypatch.setattr(store, "lock", Recording(store.lock))
    store.load("ink", folder / "ink.safetensors")
    assert events == ["read", "lock", "unlock"]
    result = engine.generate([SamplingParams(prompt="seven", seed=1, num_inference_steps=3,
                                             loras=[{"name": "ink"}])])[0]
    assert np.asarray(result.image).std() > 0
