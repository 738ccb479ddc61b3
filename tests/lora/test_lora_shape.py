"""A LoRA adapter of the wrong shape (made for a model of another size) is refused in one line that says which
adapter does not fit which part of the model, at which layer and with which shapes, not torch's kilobytes of
`size mismatch` lines; over HTTP, whether a request names it or POST /v1/loras loads it, a 400."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.server.app import create_app
from stepserve.tiny.lora import build_tiny_lora

from extras import require
from server.server_helpers import assert_error_shape


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    require("peft", "lora")
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("lora_dir")
    build_tiny_lora("embedded", root / "ink.safetensors", seed=1, rank=4)
    state = load_file(root / "ink.safetensors")  # as if made for a model twice as wide: every lora_B doubled
    save_file({k: torch.cat([v, v]) if "lora_B" in k else v for k, v in state.items()}, root / "wide.safetensors")
    built = build_engine(EngineConfig(model="embedded", memory_cap=False, warm_up=False, lora_dir=str(root),
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        yield client


def says_it_in_one_line(message: str) -> None:
    assert "\n" not in message and len(message) < 400, message
    assert "'wide'" in message and "does not fit this model's" in message and "more layers differ" in message
    assert "size mismatch" not in message and "torch.Size" not in message


def test_a_request_naming_an_adapter_of_the_wrong_shape(client):
    answer = client.post("/v1/images/generations", json={"prompt": "seven", "num_inference_steps": 2,
                                                          "loras": [{"name": "wide"}]})
    error = assert_error_shape(answer, 400)
    assert error["param"] == "loras"
    says_it_in_one_line(error["message"])


def test_loading_an_adapter_of_the_wrong_shape(client):
    answer = client.post("/v1/loras", json={"name": "wide2", "path": "wide.safetensors"})
    says_it_in_one_line(assert_error_shape(answer, 400)["message"].replace("'wide2'", "'wide'"))
