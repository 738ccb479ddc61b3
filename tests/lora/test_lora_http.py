"""LoRA over HTTP: --lora-dir loads its adapters at start-up; GET/POST/DELETE /v1/loras behind the API key; a
path outside the folder, an adapter for another family, an unknown adapter or a scale out of range is a 400
naming it; a deleted adapter is refused at once; requests name adapters per image and the answer lists them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.lora.errors import LoraBudgetError, LoraError, LoraInUseError, LoraTooLargeError
from stepserve.server.app import create_app
from stepserve.tiny.lora import build_tiny_lora

from extras import require
from server.server_helpers import assert_error_shape

# one rank-4 adapter on the embedded model: its weights and its share of the stacks (as tests/lora/test_lora_cache.py)
RANK4_BYTES = 2 * 49152 + 24 * 4

KEY = "sk-test-lora"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    require("peft", "lora")
    root = tmp_path_factory.mktemp("lora_dir")
    build_tiny_lora("embedded", root / "ink.safetensors", seed=1, rank=4, std=0.3)
    build_tiny_lora("embedded", root / "spare" / "chalk.safetensors", seed=2, rank=8, std=0.3)
    return root


def client_for(lora_dir=None, api_key=None) -> TestClient:
    built = build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=lora_dir,
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    return TestClient(create_app(AsyncEngine(built.executor, options=built.options), api_key=api_key))


def auth(key=KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def generate(client, **body):
    return client.post("/v1/images/generations", json={"prompt": "seven", "seed": 1, "num_inference_steps": 4,
                                                        **body}, headers=auth())


def test_adapters_load_list_serve_and_delete(folder):
    with client_for(str(folder), KEY) as client:
        assert client.get("/v1/loras").status_code == 401  # behind the API key
        listed = client.get("/v1/loras", headers=auth()).json()["data"]  # subfolders too, by their relative path
        assert [a["name"] for a in listed] == ["ink", "spare.chalk"] and listed[0]["rank"] == 4
        assert [a["path"] for a in listed] == ["ink.safetensors", "spare/chalk.safetensors"]  # relative paths
        made = client.post("/v1/loras", json={"name": "chalk", "path": "spare/chalk.safetensors"}, headers=auth())
        assert made.status_code == 201 and made.json()["rank"] == 8
        answer = generate(client, loras=[{"name": "ink", "scale": 0.8}, {"name": "chalk"}])
        assert answer.status_code == 200, answer.text
        assert answer.json()["stepserve"]["images"][0]["loras"] == [{"name": "ink", "scale": 0.8},
                                                                    {"name": "chalk", "scale": 1.0}]
        deleted = client.delete("/v1/loras/chalk", headers=auth()).json()
        assert deleted["deleted"] == "chalk" and deleted["reloadable"] is False  # loaded from a subfolder
        refused = generate(client, loras=[{"name": "chalk"}])
        assert refused.status_code == 400 and "adapter 'chalk' is not loaded; loaded: ink, spare.chalk" in refused.text
        assert client.delete("/v1/loras/chalk", headers=auth()).status_code == 404


@pytest.mark.parametrize("body,status,says", [
    ({"name": "x", "path": "/etc/passwd"}, 400, "is outside the adapter folder"),
    ({"name": "x", "path": "../elsewhere.safetensors"}, 400, "is outside the adapter folder"),
    ({"name": "x", "path": "missing.safetensors"}, 400, "no such file"),
    ({"name": "ink", "path": "ink.safetensors"}, 409, "is already loaded"),  # a name in use: delete it first
    ({"name": "bad name!", "path": "ink.safetensors"}, 400, "letters, digits"),
    ({"name": "x"}, 400, "expected exactly"),
])
def test_bad_loads_are_refused_naming_the_problem(folder, body, status, says):
    with client_for(str(folder)) as client:
        answer = client.post("/v1/loras", json=body)
    assert answer.status_code == status and says in answer.text, answer.text


@pytest.mark.parametrize("loras,says", [
    ([{"name": "nope"}], "adapter 'nope' is not loaded; loaded: ink, spare.chalk"),
    ([{"name": "ink", "scale": 9}], "scale must be a number in [-8, 8]"),
    ([{"name": "ink"}, {"name": "ink"}], "named twice"),
    ([{"adapter": "ink"}], "expected {\\\"name\\\""),
])
def test_bad_loras_fields_are_400_naming_the_field(folder, loras, says):
    with client_for(str(folder)) as client:
        answer = client.post("/v1/images/generations", json={"prompt": "seven", "loras": loras})
    assert answer.status_code == 400 and says in answer.text and "loras" in answer.text


def test_an_adapter_for_another_family_is_refused(folder, tmp_path):
    from stepserve.tiny.flux import build_tiny_flux

    flux = build_tiny_flux(tmp_path / "flux", variant="dev")
    build_tiny_lora(flux, folder / "spare" / "flux.safetensors", seed=3)
    with client_for(str(folder)) as client:
        answer = client.post("/v1/loras", json={"name": "fluxy", "path": "spare/flux.safetensors"})
    assert answer.status_code == 400 and "fluxy" in answer.text
    assert "another model family" in answer.text or "does not fit this model" in answer.text


def test_without_a_folder_nothing_is_loaded_over_http(folder):
    with client_for() as client:
        answer = client.post("/v1/loras", json={"name": "ink", "path": str(folder / "ink.safetensors")})
        assert answer.status_code == 400 and "--lora-dir" in answer.text
        assert client.get("/v1/loras").json()["data"] == []


@pytest.mark.parametrize("content,headers,status,param", [
    (b'{"name": "x", "path": "ink.safetensors"}', {"Content-Type": "text/plain"}, 415, None),
    (b'{"name": "x", "path": "' + b"a" * 5000 + b'"}', {"Content-Type": "application/json"}, 413, None),
    (b"[" * 2000 + b"]" * 2000, {"Content-Type": "application/json"}, 400, None),
    (b'{"name": "x", "path": "ink\\u0000.safetensors"}', {"Content-Type": "application/json"}, 400, "path"),
    (b'{"name": {"a": {"b": 1}}, "path": "ink.safetensors"}', {"Content-Type": "application/json"}, 400, "name"),
], ids=["text-plain", "oversized", "nested-deep", "nul-in-path", "nested-name"])
def test_load_bodies_are_json_bounded_and_checked(folder, content, headers, status, param):
    """POST /v1/loras takes declared JSON only (a web page cannot send that cross-origin to a keyless server),
    of at most a few KiB; nesting and a NUL in a field are a 400 naming the field, never a 500."""


    with client_for(str(folder)) as client:
        before = sorted(a["name"] for a in client.get("/v1/loras").json()["data"])
        answer = client.post("/v1/loras", content=content, headers=headers)
        error = assert_error_shape(answer, status)
        assert error["param"] == param, error
        assert sorted(a["name"] for a in client.get("/v1/loras").json()["data"]) == before  # nothing loaded


@pytest.mark.parametrize("raised,status,code", [
    (LoraTooLargeError("adapter 'big' (3.0 MiB) is larger than the whole adapter memory (1 MiB)", "path"), 400,
     "addon_too_large"),
    (LoraBudgetError("the adapter memory is held by adapters in use; retry later"), 429, "addon_memory_full"),
    (LoraInUseError("adapter 'big' is loaded already; delete it first"), 409, "lora_in_use"),
    (LoraError("the file is not a LoRA file diffusers reads", "path"), 400, "invalid_value"),
], ids=["too-large", "budget", "in-use", "plain"])
def test_load_statuses_come_from_the_error_types(folder, monkeypatch, raised, status, code):
    """The status and the field come from the adapter error's type and its `param`, not from its words."""


    with client_for(str(folder)) as client:
        store = client.app.state.server.engine.executor.adapters()

        def refuse(name, path, in_use=frozenset()):
            raise raised

        monkeypatch.setattr(store, "load_within_budget", refuse)
        answer = client.post("/v1/loras", json={"name": "big", "path": "ink.safetensors"})
    error = assert_error_shape(answer, status)
    assert (error["code"], error["param"], error["message"]) == (code, raised.param, str(raised))
    assert (answer.headers.get("retry-after") is not None) == (status == 429)


def test_delete_says_what_happened_and_an_evicted_folder_adapter_is_no_404(tmp_path):
    """DELETE of a folder adapter unloads it and says it stays servable (its file loads again on next use); one
    unloaded earlier to make room is no 404 either; a name that is nowhere is."""
    for i, name in enumerate(["ink", "oil"]):
        build_tiny_lora("embedded", tmp_path / f"{name}.safetensors", seed=i, rank=4, std=0.3)
    built = build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=str(tmp_path),
                                      lora_memory_mb=1.5 * RANK4_BYTES / 2**20, options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)  # room for one rank-4 adapter
    store = built.executor.adapters()
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        assert generate(client, loras=[{"name": "oil"}]).status_code == 200
        assert sorted(store.adapters) == ["oil"]  # ink was unloaded for room
        evicted = client.delete("/v1/loras/ink")
        assert evicted.status_code == 200, evicted.text
        assert evicted.json()["deleted"] == "ink" and evicted.json()["reloadable"] is True
        assert "not loaded" in evicted.json()["detail"]
        unloaded = client.delete("/v1/loras/oil").json()
        assert unloaded["reloadable"] is True and "unloaded" in unloaded["detail"] and not store.adapters
        assert generate(client, loras=[{"name": "oil"}]).status_code == 200  # loaded again on use
        missing = client.delete("/v1/loras/nope")
    error = assert_error_shape(missing, 404)
    assert error["code"] == "lora_not_found" and "nope" in error["message"]


def test_delete_of_a_posted_adapter_unloaded_for_room_forgets_it(tmp_path):
    """An adapter loaded by POST from a file that is not the folder's file of its name, and unloaded since to make
    room, is still servable (it reloads from its file): DELETE forgets it (it was a 404, and requests naming it
    went on loading it)."""
    build_tiny_lora("embedded", tmp_path / "ink.safetensors", seed=0, rank=4, std=0.3)
    build_tiny_lora("embedded", tmp_path / "spare" / "oil.safetensors", seed=1, rank=4, std=0.3)
    built = build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=str(tmp_path),
                                      lora_memory_mb=1.5 * RANK4_BYTES / 2**20,
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    store = built.executor.adapters()
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        assert client.post("/v1/loras", json={"name": "paint", "path": "spare/oil.safetensors"}).status_code == 201
        assert generate(client, loras=[{"name": "ink"}]).status_code == 200
        assert sorted(store.adapters) == ["ink"] and "paint" in store.names  # unloaded for room, still servable
        deleted = client.delete("/v1/loras/paint")
        assert deleted.status_code == 200, deleted.text
        assert deleted.json()["reloadable"] is False and "refused" in deleted.json()["detail"]
        refused = generate(client, loras=[{"name": "paint"}])
        assert refused.status_code == 400 and "adapter 'paint' is not loaded" in refused.text
        assert "paint" not in store.names and sorted(store.adapters) == ["ink"]  # nothing loaded for it
