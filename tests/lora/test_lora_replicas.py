"""Adapters registered once for every replica, in one process: two engines, each with its own app and its own
adapter memory, on one state store. A LoRA POSTed through A under a new name, from a subfolder of the adapter
folder, serves requests through B (each image equal to diffusers' load_lora_weights image); after DELETE through
A, B refuses it; GET /v1/loras on either shows the same registrations and which replicas hold each."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from stepserve import SamplingParams
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.server.app import create_app
from stepserve.store.memory import MemoryStore
from stepserve.tiny.lora import build_tiny_lora

from extras import require
from lora_reference import diffusers_sd, pixels
from server.server_helpers import wait_until
from step_gate import SteppedExecutor
from store.redis_server import redis_url  # noqa: F401  (a fixture)
from store.store_backends import open_backend

HANG_S = 120.0  # a bound on a hang only: every wait below waits on the servers' own state


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    require("peft", "lora")
    root = tmp_path_factory.mktemp("lora_replicas")
    build_tiny_lora(tiny_sd_path, root / "styles" / "paint.safetensors", seed=7, rank=4, std=0.4)
    return root


@pytest.fixture(params=("memory", "sqlite", "redis"))
def shared(request, tmp_path):
    """The state store both apps use, of each backend (Redis: a real redis-server, a key prefix of its own)."""
    location, prefix = "", ""
    if request.param == "sqlite":
        location = str(tmp_path / "state.db")
    elif request.param == "redis":
        location, prefix = request.getfixturevalue("redis_url"), f"lora-{uuid.uuid4().hex[:8]}:"
    store = open_backend(request.param, location, prefix)
    yield store
    store.close()


@contextlib.contextmanager
def replicas(tiny_sd_path, folder, period_s: float | None = None, store=None, wrap_b=None):
    """Clients of two apps ("a" and "b") on one state store (a MemoryStore unless given); `period_s`: B's sync
    period (a long one leaves B to hear of new registrations only through a request); `wrap_b`: wraps B's
    executor."""
    store = MemoryStore() if store is None else store
    clients = []
    for name in ("a", "b"):
        built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                          lora_dir=str(folder), options=EngineOptions(strategy="continuous")),
                             say=lambda _: None)
        executor = wrap_b(built.executor) if name == "b" and wrap_b is not None else built.executor
        app = create_app(AsyncEngine(executor, options=built.options), store=store, replica=name)
        if name == "b" and period_s is not None:
            app.state.lora_registry.period_s = period_s
        clients.append(TestClient(app))
    with clients[0] as a, clients[1] as b:
        yield a, b


async def settled(registry) -> None:
    """Once the deletions and replacements the registry's passes started have ended."""
    await asyncio.gather(*registry._work, return_exceptions=True)


def registry(client):
    return client.app.state.lora_registry


def adapters(client):
    return client.app.state.server.engine.executor.adapters()


def image(client, i: int, scale: float, name: str = "brush"):
    answer = client.post("/v1/images/generations", json={
        "prompt": f"a small cat {i}", "seed": 300 + i, "num_inference_steps": 6, "guidance_scale": 4.0,
        "sampler": "dpmpp_2m", "size": "16x16", "loras": [{"name": name, "scale": scale}]})
    return answer


def decoded(answer) -> np.ndarray:
    assert answer.status_code == 200, answer.text
    return pixels(Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"]))))


@functools.cache  # the same for every backend
def reference(tiny_sd_path, folder, i: int, scale: float) -> np.ndarray:
    p = SamplingParams(prompt=f"a small cat {i}", seed=300 + i, num_inference_steps=6, guidance_scale=4.0)
    return diffusers_sd(tiny_sd_path, {"brush": folder / "styles" / "paint.safetensors"}, p, (("brush", scale),))


def test_registered_through_one_replica_serves_through_the_other(tiny_sd_path, folder, shared):
    with replicas(tiny_sd_path, folder, period_s=3600, store=shared) as (a, b):  # B's sync ran once, before the POST
        assert "brush" not in adapters(b).names
        made = a.post("/v1/loras", json={"name": "brush", "path": "styles/paint.safetensors"})
        assert made.status_code == 201, made.text
        first = image(b, 0, 1.0)  # B looks the name up in the store once, then loads it on this first use
        assert first.status_code == 200 and "brush" in adapters(b).adapters, first.text
        got = {(0, 1.0): decoded(first)}
        for i, (client, scale) in enumerate([(a, 0.8), (b, 0.8), (a, 1.2), (b, 0.5)], start=1):
            got[(i, scale)] = decoded(image(client, i, scale))
        for (i, scale), pixels_got in got.items():
            assert np.abs(pixels_got - reference(tiny_sd_path, folder, i, scale)).max() <= 1, (i, scale)
        plain = b.post("/v1/images/generations", json={"prompt": "a small cat 0", "seed": 300, "size": "16x16",
                                                       "num_inference_steps": 6, "guidance_scale": 4.0,
                                                       "sampler": "dpmpp_2m"})
        assert np.abs(decoded(plain) - got[(0, 1.0)]).max() > 8  # the adapter did change the image

        for client in (a, b):  # each publishes what it holds
            client.portal.call(registry(client).sync_once)
        listed = [client.get("/v1/loras").json()["data"] for client in (a, b)]
        assert listed[0] == listed[1]
        brush = next(e for e in listed[0] if e["name"] == "brush")
        assert brush["registered"] is True and brush["replicas"] == ["a", "b"]
        assert brush["path"] == "styles/paint.safetensors" and brush["rank"] == 4
        folder_one = next(e for e in listed[0] if e["name"] == "styles.paint")  # the folder's own name for the file
        assert folder_one["registered"] is False and folder_one["replicas"] == ["a", "b"]  # loaded at start-up

        assert a.delete("/v1/loras/brush").status_code == 200
        assert image(a, 9, 1.0).status_code == 400  # refused at once where it was deleted
        assert "brush" in adapters(b).names  # B has not run its sync since
        b.portal.call(registry(b).sync_once)
        b.portal.call(settled, registry(b))
        refused = image(b, 9, 1.0)
        assert refused.status_code == 400 and "adapter 'brush' is not loaded" in refused.text
        assert "brush" not in adapters(b).adapters  # unloaded (no request carried it)
        for client in (a, b):
            client.portal.call(registry(client).sync_once)
        listed = [client.get("/v1/loras").json()["data"] for client in (a, b)]
        assert listed[0] == listed[1] and "brush" not in [e["name"] for e in listed[0]]


def test_the_sync_serves_and_deletes_on_every_replica_without_a_request(tiny_sd_path, folder, shared):
    """B's own sync task (every second) makes a registration servable and refuses a deleted one: B is sent no
    request until its passes have run."""
    with replicas(tiny_sd_path, folder, store=shared) as (a, b):
        sync = registry(b)
        assert sync.period_s <= 1.0  # a deletion is refused everywhere within a few seconds
        assert a.post("/v1/loras", json={"name": "brush", "path": "styles/paint.safetensors"}).status_code == 201
        passes = sync.passes
        assert wait_until(lambda: sync.passes >= passes + 2, HANG_S)  # a whole pass after the POST
        assert "brush" in adapters(b).names and "brush" not in adapters(b).adapters  # servable, not loaded yet
        assert decoded(image(b, 3, 1.0)).shape == (16, 16, 3)
        assert a.delete("/v1/loras/brush").status_code == 200
        passes = sync.passes
        assert wait_until(lambda: sync.passes >= passes + 2, HANG_S)
        b.portal.call(settled, sync)
        assert "brush" not in adapters(b).names and "brush" not in adapters(b).adapters
        assert image(b, 3, 1.0).status_code == 400


def test_a_registration_is_the_name_on_every_replica(tiny_sd_path, folder):
    """A name registered through one replica cannot be POSTed through another with another file (409, as a
    name loaded here is); a name never registered is refused after one look-up."""
    with replicas(tiny_sd_path, folder, period_s=3600) as (a, b):
        assert a.post("/v1/loras", json={"name": "brush", "path": "styles/paint.safetensors"}).status_code == 201
        taken = b.post("/v1/loras", json={"name": "brush", "path": "styles/paint.safetensors"})
        assert taken.status_code == 409 and "registered already" in taken.text
        unknown = image(b, 1, 1.0, name="nowhere")
        assert unknown.status_code == 400 and "adapter 'nowhere' is not loaded" in unknown.text


def test_a_load_the_store_cannot_register_is_served_nowhere(tiny_sd_path, folder):
    """When the registration cannot be written, the adapter is unloaded here too (else this replica alone would
    serve it), and the answer is a 503 to retry."""
    class Unwritable(MemoryStore):
        def register_adapter(self, record):
            raise OSError("disk full")

    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False, lora_dir=str(folder),
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options), store=Unwritable())) as client:
        answer = client.post("/v1/loras", json={"name": "brush", "path": "styles/paint.safetensors"})
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
        assert answer.json()["error"]["code"] == "state_unavailable"
        assert "brush" not in adapters(client).names
        assert image(client, 1, 1.0).status_code == 400


def test_a_deleted_registration_is_refused_at_once_and_unloaded_once_its_requests_end(tiny_sd_path, folder):
    """On B, a request carrying the adapter is held mid-denoising (a step gate) while the registration is deleted
    through A: B's next pass refuses new requests naming it at once, the held request ends as it began, and the
    adapter is unloaded only then."""
    with replicas(tiny_sd_path, folder, period_s=3600, wrap_b=SteppedExecutor) as (a, b):
        gate = b.app.state.server.engine.executor
        assert a.post("/v1/loras", json={"name": "brush", "path": "styles/paint.safetensors"}).status_code == 201
        with ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as freed:
            freed.callback(gate.free)  # whatever happens, the held request ends
            held = pool.submit(image, b, 2, 1.0)
            assert gate.wait_held(HANG_S)  # B runs it, carrying brush
            assert a.delete("/v1/loras/brush").status_code == 200
            b.portal.call(registry(b).sync_once)
            assert wait_until(lambda: "brush" in adapters(b).retired, HANG_S)  # refused from now on
            refused = image(b, 3, 1.0)
            assert refused.status_code == 400 and "adapter 'brush' is not loaded" in refused.text
            assert "brush" in adapters(b).adapters and not held.done()  # still carried: not unloaded
            gate.free()
            assert np.abs(decoded(held.result(HANG_S)) - reference(tiny_sd_path, folder, 2, 1.0)).max() <= 1
        b.portal.call(settled, registry(b))
        assert "brush" not in adapters(b).adapters and "brush" not in adapters(b).names
