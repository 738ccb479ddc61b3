"""Adapters in --lora-dir: subfolders and the folders diffusers' save_lora_weights writes are discovered and load
by POST; a name with dots serves (its modules' key is another); paths show relative to the folder;
`stepserve tiny lora` writes an adapter offline; without peft the message says what to install."""

from __future__ import annotations

import sys

import pytest
from fastapi.testclient import TestClient

from stepserve.commands.tiny import main as tiny_main
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.server.app import create_app
from stepserve.tiny.lora import build_tiny_lora

from extras import require


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    require("peft", "lora")
    root = tmp_path_factory.mktemp("lora_folders")
    build_tiny_lora("embedded", root / "style.v2.safetensors", seed=1, rank=4, std=0.3)
    build_tiny_lora("embedded", root / "sub" / "mine" / "pytorch_lora_weights.safetensors", seed=2, rank=4, std=0.3)
    return root


def built(lora_dir):
    return build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=str(lora_dir),
                                     options=EngineOptions(strategy="continuous")), say=lambda _: None)


def generate(client, name):
    return client.post("/v1/images/generations", json={"prompt": "seven", "seed": 1, "num_inference_steps": 2,
                                                        "loras": [{"name": name}]})


def test_dotted_names_and_diffusers_folders_start_list_and_serve(folder):
    engine = built(folder)  # a dotted name does not stop start-up
    with TestClient(create_app(AsyncEngine(engine.executor, options=engine.options))) as client:
        listed = {a["name"]: a["path"] for a in client.get("/v1/loras").json()["data"]}
        assert listed == {"style.v2": "style.v2.safetensors", "sub.mine": "sub/mine/pytorch_lora_weights.safetensors"}
        for name in ("style.v2", "sub.mine"):
            answer = generate(client, name)
            assert answer.status_code == 200, answer.text
        made = client.post("/v1/loras", json={"name": "mine.again", "path": "sub/mine"})  # the folder itself
        assert made.status_code == 201, made.text
        assert made.json()["path"] == "sub/mine/pytorch_lora_weights.safetensors"
        assert generate(client, "mine.again").status_code == 200
        assert client.delete("/v1/loras/style.v2").json()["deleted"] == "style.v2"
        bad = client.post("/v1/loras", json={"name": "x", "path": "sub"})
        assert bad.status_code == 400 and "pytorch_lora_weights.safetensors" in bad.text
        assert str(folder) not in bad.text
        outside = client.post("/v1/loras", json={"name": "x", "path": "/etc/hostname"})
        assert outside.status_code == 400 and str(folder) not in outside.text
        nul = client.post("/v1/loras", json={"name": "x", "path": "style\u0000.safetensors"})
        assert nul.status_code == 400 and "NUL" in nul.text


def test_stepserve_tiny_lora_writes_an_adapter_the_server_loads(tmp_path):
    require("peft", "lora")
    assert tiny_main(["lora", "--model", "embedded", "--out", str(tmp_path / "ink.safetensors"), "--rank", "8"]) == 0
    assert tiny_main(["lora", "--out", str(tmp_path / "chalk")]) == 0  # a folder, as save_lora_weights writes
    store = built(tmp_path).executor.adapters()
    assert sorted(store.adapters) == ["chalk", "ink"] and store.adapters["ink"].rank == 8


def test_without_peft_the_message_names_the_extra(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # peft not importable
    with pytest.raises(ValueError, match=r"install stepserve\[lora\]"):
        built(folder)
