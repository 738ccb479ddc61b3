"""LoRA admission under load: requests waiting for an adapter load wait on a thread of the engine's own, never
on the event loop nor in asyncio's shared executor, so /health and plain image requests answer while a load is
blocked; a request that never gets queued carries (pins) no adapter."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from extras import require
from server.server_helpers import ServerThread, wait_until
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.server.app import create_app
from stepserve.tiny.lora import build_tiny_lora

GENERATIONS = "/v1/images/generations"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    require("peft", "lora")
    root = tmp_path_factory.mktemp("lora_admission")
    for i, name in enumerate(["ink", "oil"]):
        build_tiny_lora("embedded", root / f"{name}.safetensors", seed=i, rank=4, std=0.3)
    return root


def built_for(folder, strategy: str):
    return build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=str(folder),
                                     options=EngineOptions(strategy=strategy)), say=lambda _: None)


def body(**extra) -> dict:
    return {"prompt": "seven", "seed": 1, "num_inference_steps": 1, **extra}


@pytest.mark.parametrize("strategy", ["slo", "continuous"])
def test_requests_waiting_on_a_slow_adapter_load_leave_the_server_answering(folder, strategy, monkeypatch):
    """More requests for an unloaded adapter than asyncio's default executor has threads, and one for a loaded
    adapter, all wait while the load is held on an event this test controls; meanwhile /health and a plain image
    request are answered (the load still held when they are)."""
    built = built_for(folder, strategy)
    store = built.executor.adapters()
    store.delete("oil")  # loaded again on first use: that load is held
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    read = store.injector.read  # reading the adapter's file: the I/O of a load

    def held_read(file):
        entered.set()
        release.wait(600)
        try:
            return read(file)
        finally:
            returned.set()

    monkeypatch.setattr(store.injector, "read", held_read)
    engine = AsyncEngine(built.executor, options=built.options)
    seen: list[str] = []  # the adapter each request names, as the engine builds it (on the event loop)
    new_request = engine.core.new_request

    def counting(params, *args, **kwargs):
        request = new_request(params, *args, **kwargs)
        seen.append(request.params.loras[0][0] if request.params.loras else "")
        return request

    monkeypatch.setattr(engine.core, "new_request", counting)
    waiting = max(20, min(32, (os.cpu_count() or 1) + 4) + 1)  # more than asyncio's default executor's threads
    with ServerThread(create_app(engine)) as server, ThreadPoolExecutor(waiting + 1) as pool, \
            httpx.Client(base_url=server.url, timeout=600) as http:
        try:
            lora = [pool.submit(http.post, GENERATIONS, json=body(seed=i, loras=[{"name": "oil"}]))
                    for i in range(waiting)]
            assert entered.wait(120) and wait_until(lambda: seen.count("oil") == waiting, 120)
            lora.append(pool.submit(http.post, GENERATIONS, json=body(loras=[{"name": "ink"}])))  # loaded already
            assert wait_until(lambda: "ink" in seen, 120)
            # from here the request naming ink is being admitted while the load holds the adapter gate
            assert http.get("/health", timeout=60).status_code == 200
            plain = http.post(GENERATIONS, json=body(), timeout=120)
            assert plain.status_code == 200, plain.text
            assert not returned.is_set() and not any(f.done() for f in lora)  # the load was held throughout
        finally:
            release.set()
        answers = [f.result() for f in lora]
    assert [a.status_code for a in answers] == [200] * (waiting + 1), [a.text for a in answers if a.status_code != 200]


def test_a_request_that_fails_to_queue_does_not_pin_its_adapter(folder, monkeypatch):
    """A request accepted but failed on its way into the queue (here the core refuses it) carries no adapter:
    DELETE then unloads it at once instead of waiting for a request that will never end."""
    built = built_for(folder, "continuous")
    engine = AsyncEngine(built.executor, options=built.options)
    enqueue = engine.core.enqueue

    def refuse_ink(request):
        if request.params.loras:
            raise RuntimeError("no room in the queue")
        enqueue(request)

    monkeypatch.setattr(engine.core, "enqueue", refuse_ink)
    with TestClient(create_app(engine)) as client:
        failed = client.post(GENERATIONS, json=body(loras=[{"name": "ink"}]))
        assert failed.status_code == 500 and "could not queue" in failed.text
        assert engine.adapter_gate.in_use() == set()
        deleted = client.delete("/v1/loras/ink")
        assert deleted.status_code == 200 and deleted.json()["deleted"] == "ink", deleted.text
        assert "ink" not in built.executor.adapters().adapters
