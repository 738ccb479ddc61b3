"""Over HTTP (generations and edits), a first use of a ControlNet and of an IP-Adapter loads before the request is
queued, on a thread of the front end's own, never inside a step on the engine thread: while the load is held (on an
event the test controls) a plain request is served to the end; the held request then runs with its add-on loaded.
The HTTP path hands the engine resolved params (Control / ImagePrompt objects), not the body's dicts."""

from __future__ import annotations

import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from control_reference import build_controlnets
from edit_images import start_image
from fastapi.testclient import TestClient
from ip_adapter_reference import build_ip_adapters

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.server.app import create_app

ENGINE_THREAD = "stepserve-engine"


@pytest.fixture(scope="module")
def served(tiny_sd_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("addons")
    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      controlnet_dir=str(build_controlnets(tiny_sd_path, root / "controlnets")),
                                      ip_adapter_dir=str(build_ip_adapters(tiny_sd_path, root / "ip_adapters")),
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        yield client, built.executor


class HeldLoads:
    """Wraps a store's public `ensure`: a call that has to load records its thread and, off the engine thread,
    waits for `release` (on the engine thread it never waits: that is the failure the test reports)."""

    def __init__(self, store) -> None:
        self.store, self.ensure = store, store.ensure
        self.loading, self.release = threading.Event(), threading.Event()
        self.threads: list[str] = []
        store.ensure = self

    def __call__(self, names, *args, **kwargs):
        wanted = [names] if isinstance(names, str) else list(names)
        if any(n not in self.store.loaded for n in wanted):
            self.threads.append(threading.current_thread().name)
            self.loading.set()
            if threading.current_thread().name != ENGINE_THREAD:
                assert self.release.wait(120)
        return self.ensure(names, *args, **kwargs)

    def undo(self) -> None:
        self.release.set()
        self.store.ensure = self.ensure


def b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


BASE = {"prompt": "a small cat", "seed": 5, "num_inference_steps": 4, "guidance_scale": 4.0, "size": "16x16"}
ADDONS = {
    "controlnet": ("controlnets", "depth",
                   lambda: {"json": {**BASE, "n": 2, "controls": [{"name": "depth", "image": b64(start_image(1))}]}}),
    "ip_adapter": ("ip_adapters", "style",
                   lambda: {"json": {**BASE, "ip_adapter": {"name": "style", "image": b64(start_image(2))}}}),
    "controlnet_edit": ("controlnets", "edge", lambda: {
        "data": {"prompt": "a small cat", "num_inference_steps": "4", "size": "16x16", "controls[0][name]": "edge"},
        "files": {"image": ("i.png", png(start_image(3))), "controls[0][image]": ("c.png", png(start_image(4)))}}),
    "ip_adapter_edit": ("ip_adapters", "face", lambda: {
        "data": {"prompt": "a small cat", "num_inference_steps": "4", "size": "16x16", "ip_adapter[name]": "face"},
        "files": {"image": ("i.png", png(start_image(5))), "ip_adapter[image]": ("p.png", png(start_image(6)))}}),
}


@pytest.mark.parametrize("kind", list(ADDONS))
def test_a_first_use_loads_before_queueing_while_plain_requests_run(served, kind):
    client, executor = served
    getter, name, body = ADDONS[kind]
    store = getattr(executor, getter)()
    assert name not in store.loaded
    held = HeldLoads(store)
    route = "/v1/images/edits" if "files" in body() else "/v1/images/generations"
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.post, route, **body())
            assert held.loading.wait(120)
            plain = client.post("/v1/images/generations", json=BASE)  # served while the load is held
            assert plain.status_code == 200, plain.text
            assert not first.done() or ENGINE_THREAD in held.threads
            held.release.set()
            answer = first.result()
    finally:
        held.undo()
    assert answer.status_code == 200, answer.text
    assert held.threads and ENGINE_THREAD not in held.threads, held.threads  # loaded once, off the engine thread
    assert name in store.loaded
