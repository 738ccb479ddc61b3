"""The ControlNet memory, decided by the add-ons' one budgeted store (stepserve/addons/store.py): two requests with
different ControlNets and room for one never unload each other's (each ControlNet loads at most once per request;
the second is told to retry), a ControlNet's size is known from its weights file before it is read, one larger
than the whole memory is refused without a load and remembered, and over HTTP each of these errors is the
client's answer (400 naming the field, or 429 with Retry-After), not a 500."""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections import Counter

import pytest
from control_reference import WEIGHTS, build_controlnets, request
from edit_images import start_image
from fastapi.testclient import TestClient

from stepserve import Engine
from stepserve.addons import sizes
from stepserve.addons.store import Holder
from stepserve.controls.errors import ControlNetBudgetError, ControlNetError, ControlNetTooLargeError
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.ipadapter.parts import IPAdapterError
from stepserve.lora.errors import LoraTooLargeError
from stepserve.request.types import FinishReason, GenerationResult, RequestStatus, RequestTiming
from stepserve.server.errors import APIError
from stepserve.server.images import check
from stepserve.server.app import create_app
from server.server_helpers import assert_error_shape

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    return build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))


def one_size(folder) -> int:
    """A tiny ControlNet's bytes in float32, from its file's header (all three are the same size)."""
    return sizes.file_bytes(folder / "pose" / WEIGHTS, 4)


def counting_loads(pipeline, monkeypatch) -> Counter:
    """Per ControlNet folder name, how many times it was read from disk."""
    loads: Counter = Counter()
    cls = pipeline.controlnet_class()

    class Counted:
        @staticmethod
        def from_pretrained(path, **kw):
            loads[path.name] += 1
            return cls.from_pretrained(path, **kw)

    monkeypatch.setattr(pipeline, "controlnet_class", lambda: Counted)
    return loads


def test_two_requests_with_different_controlnets_and_room_for_one_load_each_once(tiny_sd_path, folder,
                                                                                 monkeypatch):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=4,
                                    controlnet_dir=str(folder))
    store = engine.executor.controlnets()
    store.budget_bytes = int(1.5 * one_size(folder))  # room for one
    loads = counting_loads(engine.executor.pipeline, monkeypatch)
    first, second = engine.generate([request(1, (("pose", 1.0, 0.0, 1.0),), steps=8),
                                     request(2, (("depth", 1.0, 0.0, 1.0),), steps=8)])
    assert first.ok and loads == {"pose": 1}  # the ControlNet of the request in flight is never unloaded
    assert not second.ok and isinstance(second.cause, ControlNetBudgetError) and "retry later" in second.error
    again = engine.generate([request(2, (("depth", 1.0, 0.0, 1.0),), steps=8)])[0]  # the retry: pose is idle now
    assert again.ok and loads == {"pose": 1, "depth": 1} and store.evictions == 1


def test_the_size_is_read_before_the_load_and_too_large_is_remembered(tiny_sd_path, folder, monkeypatch):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", controlnet_dir=str(folder))
    store = engine.executor.controlnets()
    store.budget_bytes = one_size(folder) // 2
    loads = counting_loads(engine.executor.pipeline, monkeypatch)
    for _ in range(2):
        with pytest.raises(ControlNetTooLargeError, match="larger than the whole ControlNet memory"):
            store.ensure(["pose"])
    assert loads == {} and store.loaded == {}  # refused without a load, twice
    store.budget_bytes = 2 * one_size(folder)  # a larger memory serves it
    assert set(store.ensure(["pose"])) == {"pose"} and store.loaded["pose"].bytes == one_size(folder)


def test_the_size_counts_the_dtype_in_force(folder):
    """A float32 file served in bfloat16 takes half its bytes (and a 16-bit one in float32 twice its own)."""
    assert sizes.file_bytes(folder / "pose" / WEIGHTS, 2) * 2 == one_size(folder)


@pytest.fixture(scope="module")
def served(tiny_sd_path, folder):
    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      controlnet_dir=str(folder), options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        yield client, built.executor.controlnets()


def post(client, name):
    buffer = io.BytesIO()
    start_image(3, size=16).save(buffer, format="PNG")
    return client.post("/v1/images/generations", json={
        "prompt": "a small cat", "seed": 3, "num_inference_steps": 2, "size": "16x16",
        "controls": [{"name": name, "image": base64.b64encode(buffer.getvalue()).decode()}]})


def test_over_http_too_large_is_400_and_a_held_memory_429(served, folder):
    client, store = served
    store.budget_bytes = one_size(folder) // 2
    try:
        answer = post(client, "edge")
        error = assert_error_shape(answer, 400)
        assert error["param"] == "controls" and error["code"] == "addon_too_large"
        assert "larger than the whole ControlNet memory" in error["message"] and "\n" not in error["message"]
        store.budget_bytes = int(1.5 * one_size(folder))
        assert post(client, "pose").status_code == 200
        busy = Holder()  # a request in flight that uses pose
        store.budget.hold(busy, ["pose"])
        answer = post(client, "depth")
        assert answer.status_code == 429 and answer.headers["Retry-After"] == "1", answer.text
        assert answer.json()["error"]["param"] == "controls" and "retry later" in answer.json()["error"]["message"]
        store.budget.release(busy)
        assert post(client, "depth").status_code == 200
    finally:
        store.budget_bytes = None


def test_over_http_a_controlnet_of_another_model_is_400(served, folder):
    client, store = served
    other = folder / "wide"
    other.mkdir()
    config = json.loads((folder / "pose" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 64}))
    shutil.copy(folder / "pose" / WEIGHTS, other / WEIGHTS)
    try:
        answer = post(client, "wide")
    finally:
        shutil.rmtree(other)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "controls" and "cross_attention_dim 64" in error["message"]


@pytest.mark.parametrize("cause, status, param, code", [
    (ControlNetTooLargeError("too large", None), 400, "controls", "addon_too_large"),
    (ControlNetError("the ControlNets a, b give different numbers of block outputs"), 400, "controls",
     "invalid_value"),
    (ControlNetBudgetError("does not fit beside; retry later"), 429, "controls", "addon_memory_full"),
    (IPAdapterError("does not fit this model"), 400, "ip_adapter", "invalid_value"),
    (LoraTooLargeError("too large", "loras"), 400, "loras", "addon_too_large"),
])
def test_a_request_failed_on_an_add_on_answers_with_its_typed_error(cause, status, param, code):
    failed = GenerationResult("req-1", RequestStatus.FAILED, None, None, RequestTiming(arrival=0.0),
                              FinishReason.ERROR, f"prepare failed: {type(cause).__name__}: {cause}", cause=cause)
    with pytest.raises(APIError) as err:
        check(failed)
    assert (err.value.status, err.value.param, err.value.code) == (status, param, code)
    assert err.value.message == str(cause)  # the add-on's own line, not "the model failed ..."
    assert (err.value.headers.get("Retry-After") == "1") == (status == 429)


def test_a_queued_request_holds_the_controlnet_loaded_for_it_before_its_first_step(tiny_sd_path, folder,
                                                                                    monkeypatch):
    """What the front end loads before queueing stays loaded until the request's first step: a request waiting in
    the queue holds its ControlNet, so another's preload cannot unload it (which would load it again inside a step,
    on the engine thread)."""
    import asyncio

    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      controlnet_dir=str(folder),
                                      options=EngineOptions(strategy="static", max_batch_size=2,
                                                            static_batch_size=2, max_queue_delay_ms=600_000)),
                         say=lambda _: None)
    store = built.executor.controlnets()
    store.budget_bytes = int(1.5 * one_size(folder))  # room for one
    loads = counting_loads(built.executor.pipeline, monkeypatch)

    async def scenario():
        engine = AsyncEngine(built.executor, options=built.options)
        await engine.start()
        try:
            waiting = await engine.submit_many_off_loop([request(1, (("pose", 1.0, 0.0, 1.0),))])
            held = store.budget.in_use()
            await engine.preload_addons([request(2, (("depth", 1.0, 0.0, 1.0),))])  # refused room: swallowed
            return waiting, held
        finally:
            await engine.shutdown(1.0)

    waiting, held = asyncio.run(scenario())
    assert waiting and "pose" in held
    assert loads == {"pose": 1} and "pose" in store.loaded  # depth did not unload it
