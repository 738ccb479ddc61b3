"""IP-Adapters over HTTP: GET /v1/ip-adapters lists the folder's; a generation's ip_adapter carries a base64
picture, checked before decoding with the edit images' limits, and the image equals diffusers' pipeline; a list
names several adapters; a bad ip_adapter is a 400 naming the field (an edit's image prompt:
test_ip_adapter_edit_http.py)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from edit_images import start_image
from fastapi.testclient import TestClient
from ip_adapter_reference import build_ip_adapters, diffusers_ip_adapter, request
from PIL import Image

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.server.app import create_app
from server.server_helpers import assert_error_shape, decode_png, pixels


@pytest.fixture(scope="module")
def served(tiny_sd_path, tmp_path_factory):
    folder = build_ip_adapters(tiny_sd_path, tmp_path_factory.mktemp("ip_adapters"), std=0.2)
    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      ip_adapter_dir=str(folder), options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        yield client, folder


def b64(image, fmt="PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def body(ip_adapter, **extra):
    return {"prompt": "a small cat 3", "seed": 803, "num_inference_steps": 6, "guidance_scale": 4.0,
            "sampler": "dpmpp_2m", "size": "16x16", "ip_adapter": ip_adapter, **extra}


def test_listed_then_served_equal_to_diffusers(served, tiny_sd_path):
    client, folder = served
    listed = client.get("/v1/ip-adapters").json()["data"]
    assert [(a["name"], a["loaded"]) for a in listed] == [("face", False), ("style", False)]
    p = request(3, "style", 0.8)
    sent = {"name": "style", "image": "data:image/png;base64," + b64(p.ip_adapter["image"]), "scale": 0.8}
    answer = client.post("/v1/images/generations", json=body(sent))
    assert answer.status_code == 200, answer.text
    got = decode_png(answer.json()["data"][0]["b64_json"])
    assert np.abs(pixels(got) - diffusers_ip_adapter(tiny_sd_path, folder, p)).max() <= 1
    assert answer.json()["stepserve"]["images"][0]["ip_adapter"] == {"name": "style", "scale": 0.8}
    listed = {a["name"]: a["loaded"] for a in client.get("/v1/ip-adapters").json()["data"]}
    assert listed == {"face": False, "style": True}


@pytest.mark.parametrize("ip_adapter,param,says", [
    ({"name": "face", "image": "not base64!"}, "ip_adapter.image", "not base64"),
    ({"name": "face", "image": [1, 2]}, "ip_adapter.image", "expected a base64 PNG, JPEG or WebP image"),
    ({"name": "face", "image": base64.b64encode(b"plain text").decode()}, "ip_adapter.image",
     "not a PNG, JPEG or WebP"),
    ({"name": "face", "image": b64(Image.new("RGB", (5000, 4)))}, "ip_adapter.image", "larger than this server"),
    ({"name": "face", "image": b64(start_image(1)), "scale": 11}, "ip_adapter.scale", "must be a number in [0, 10]"),
    ({"name": "mystery", "image": b64(start_image(1))}, "ip_adapter.name", "served: face, style"),
    ({"name": "face", "image": b64(start_image(1)), "weight": 1}, "ip_adapter", "unknown key(s) weight"),
    ([{"name": "face", "image": b64(start_image(1))}, {"name": "style", "image": "not base64!"}],
     "ip_adapter[1].image", "not base64"),
    ([{"name": "face", "image": b64(start_image(1))}, {"name": "face", "image": b64(start_image(2))}],
     "ip_adapter[1].name", "named twice"),
])
def test_bad_ip_adapter_is_a_400_naming_the_field(served, ip_adapter, param, says):
    client, _ = served
    error = assert_error_shape(client.post("/v1/images/generations", json=body(ip_adapter)), 400)
    assert error["param"] == param and says in error["message"], error


def test_an_image_prompt_lifts_the_json_body_limit(served):
    client, _ = served
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (160, 160, 3), dtype=np.uint8))
    sent = {"name": "face", "image": b64(noisy)}
    assert len(sent["image"]) > 64 * 1024
    answer = client.post("/v1/images/generations", json=body(sent))
    assert answer.status_code == 200, answer.text


def test_an_async_request_with_an_image_prompt_gives_the_synchronous_image(served):
    from jobs.job_helpers import wait_job

    client, _ = served
    sent = body({"name": "face", "image": b64(start_image(5)), "scale": 0.9})
    sync = client.post("/v1/images/generations", json=sent)
    plain = client.post("/v1/images/generations", json=body(None))
    created = client.post("/v1/images/generations", json=sent, headers={"Prefer": "respond-async"})
    assert created.status_code == 202, created.text
    done = wait_job(client, f"/v1/images/jobs/{created.json()['id']}")
    assert done["status"] == "completed", done
    assert done["result"]["data"][0]["b64_json"] == sync.json()["data"][0]["b64_json"]
    assert sync.json()["data"][0]["b64_json"] != plain.json()["data"][0]["b64_json"]
    assert done["result"]["stepserve"]["images"][0]["ip_adapter"] == {"name": "face", "scale": 0.9}


def test_several_adapters_in_one_request_answer_as_a_list(served):
    client, _ = served
    one = {"name": "face", "image": b64(start_image(5)), "scale": 0.9}
    two = [one, {"name": "style", "image": b64(start_image(6, size=40)), "scale": 1.5}]
    single, several = (client.post("/v1/images/generations", json=body(sent)) for sent in (one, two))
    assert single.status_code == 200 and several.status_code == 200, several.text
    assert several.json()["stepserve"]["images"][0]["ip_adapter"] == [{"name": "face", "scale": 0.9},
                                                                      {"name": "style", "scale": 1.5}]
    images = [pixels(decode_png(r.json()["data"][0]["b64_json"])) for r in (single, several)]
    assert np.abs(images[0] - images[1]).max() > 4  # the second adapter's image prompt counts
