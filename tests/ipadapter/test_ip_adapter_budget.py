"""The IP-Adapter memory, decided by the add-ons' one budgeted store: adapters whose image encoders are the same
(the same config and weights) share one copy of it loaded, as diffusers' pipeline keeps one image encoder for all
its adapters, and it counts once; over HTTP an adapter larger than the whole memory is a 400 naming the field, and
one that does not fit beside the adapters requests in flight use a 429 with Retry-After, not a 500."""

from __future__ import annotations

import base64
import io

import pytest
from edit_images import start_image
from fastapi.testclient import TestClient

from stepserve.addons.store import Holder
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.engine.loading import load_executor
from stepserve.ipadapter.store import IPAdapterStore
from stepserve.server.app import create_app
from stepserve.tiny.ipadapter import build_tiny_ip_adapter
from server.server_helpers import assert_error_shape


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ip_adapters")
    build_tiny_ip_adapter(tiny_sd_path, out / "face", seed=1)
    build_tiny_ip_adapter(tiny_sd_path, out / "face2", seed=2, encoder_seed=1)  # face's image encoder
    build_tiny_ip_adapter(tiny_sd_path, out / "style", seed=3)
    return out


def test_adapters_with_one_image_encoder_share_one_copy(tiny_sd_path, folder):
    executor = load_executor(str(tiny_sd_path))
    probe = IPAdapterStore(executor.pipeline, folder, executor.lock)
    face, face2, style = (probe.ensure(n) for n in ("face", "face2", "style"))
    assert face.encoder is face2.encoder and style.encoder is not face.encoder and len(probe.encoders) == 2
    encoder = sum(t.numel() * t.element_size() for t in face.encoder.parameters())
    assert probe.loaded_bytes == face.bytes + face2.bytes + style.bytes - encoder  # the shared one counts once
    store = IPAdapterStore(executor.pipeline, folder, executor.lock, budget_bytes=face.bytes + face2.bytes - encoder)
    store.ensure("face")
    store.ensure("face2")  # fits beside face: its encoder is loaded already
    assert set(store.loaded) == {"face", "face2"} and store.evictions == 0 and store.loads == 2
    store.ensure("style")  # both idle: unloaded, and their encoder with the last of them
    assert set(store.loaded) == {"style"} and list(store.encoders) == [store.loaded["style"].part]


@pytest.fixture(scope="module")
def served(tiny_sd_path, folder):
    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      ip_adapter_dir=str(folder), options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        yield client, built.executor.ip_adapters()


def post(client, name):
    buffer = io.BytesIO()
    start_image(5, size=24).save(buffer, format="PNG")
    return client.post("/v1/images/generations", json={
        "prompt": "a small cat", "seed": 5, "num_inference_steps": 2, "size": "16x16",
        "ip_adapter": {"name": name, "image": base64.b64encode(buffer.getvalue()).decode()}})


def test_over_http_too_large_is_400_and_a_held_memory_429(served):
    client, store = served
    assert post(client, "style").status_code == 200
    one = store.loaded["style"].bytes
    store.budget_bytes = one // 2
    try:
        answer = post(client, "face")
        error = assert_error_shape(answer, 400)
        assert error["param"] == "ip_adapter" and error["code"] == "addon_too_large"
        assert "larger than the whole IP-Adapter memory" in error["message"]
        store.budget_bytes = int(1.5 * one)
        busy = Holder()  # a request in flight with an image prompt of style
        store.budget.hold(busy, ["style"])
        answer = post(client, "face")
        assert answer.status_code == 429 and answer.headers["Retry-After"] == "1", answer.text
        assert answer.json()["error"]["param"] == "ip_adapter" and "retry later" in answer.json()["error"]["message"]
        store.budget.release(busy)
        assert post(client, "face").status_code == 200
    finally:
        store.budget_bytes = None
