"""A generation's add-on pictures over HTTP are read once per request and off the event loop: a large body's JSON,
each picture's base64 and pixels, and the Canny map, whatever `n` is; only the pictures may take a body past the
JSON limit. One decoder (server/pictures.py) reads every picture, and a 16-bit grayscale one (a depth map) is
scaled to 8 bits, not clipped white."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from types import SimpleNamespace

import numpy as np
import pytest
from control_reference import build_controlnets
from fastapi.testclient import TestClient
from PIL import Image

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine

from stepserve.request.validation import as_image
from stepserve.server import controlnets, pictures
from stepserve.server.app import create_app

from extras import require

@pytest.fixture(scope="module")
def client(tiny_sd_path, tmp_path_factory):
    folder = build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))
    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      controlnet_dir=str(folder), options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        yield client

def png64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()

def noise_photo(side: int = 192):
    """A photo-like picture whose PNG is larger than the JSON limit (64 KiB): noise does not compress."""
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))

def on_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False

def watched(monkeypatch, module, name: str, calls: list):
    """Wrap `module.name`, recording for each call whether it ran on an event loop's thread."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append((name, on_loop(), threading.current_thread().name))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)

def test_parse_decode_and_canny_run_once_per_request_off_the_loop(client, monkeypatch):
    require("cv2", "canny")
    from stepserve.controls import preprocess

    calls: list = []
    for module, name in ((controlnets, "parse_body"), (pictures, "from_base64"), (pictures, "decode"),
                         (preprocess, "canny")):
        watched(monkeypatch, module, name, calls)
    photo = png64(noise_photo())
    assert len(photo) > 64 * 1024
    body = {"prompt": "a small cat", "seed": 9, "n": 3, "num_inference_steps": 3, "size": "16x16",
            "controls": [{"name": "edge", "image": photo, "preprocess": "canny"}]}
    answer = client.post("/v1/images/generations", json=body)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"]) == 3
    assert sorted(name for name, _, _ in calls) == ["canny", "decode", "from_base64", "parse_body"]  # once each
    assert not [c for c in calls if c[1]], calls  # none on the event loop

@pytest.mark.parametrize("padding,status", [(0, 200), (70 * 1024, 413)])
def test_only_pictures_may_pass_the_json_limit(client, padding, status):
    """A body naming controls is padded past the 64 KiB JSON limit by something else than its pictures (JSON
    whitespace here; prompt text alike): 413, as any other body."""
    body = ('{"prompt": "a small cat", "num_inference_steps": 2, "size": "16x16",' + " " * padding
            + '"controls": [{"name": "depth", "image": "' + png64(noise_photo(48)) + '"}]}')
    answer = client.post("/v1/images/generations", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    if status == 413:
        assert "only the pictures" in answer.json()["error"]["message"]

def sixteen_bit_gradient():
    levels = (np.arange(32 * 32, dtype=np.uint32).reshape(32, 32) * 64).astype(np.uint16)  # 0 .. 65472
    return levels, Image.fromarray(levels)

@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_16_bit_grayscale_is_scaled_not_clipped(mode):
    levels, image = sixteen_bit_gradient()
    assert image.mode == "I;16"
    got = np.asarray(as_image("image", image, mode)).astype(np.int32)
    want = np.rint(levels / 257).astype(np.int32)
    assert np.abs((got if mode == "L" else got[..., 0]) - want).max() == 0
    wide = np.asarray(as_image("image", image.convert("I"), mode))  # mode "I": how older Pillows open 16-bit PNGs
    assert np.array_equal(wide, np.asarray(as_image("image", image, mode)))
    eight = Image.fromarray(np.full((4, 4), 200, dtype=np.int32))  # mode "I" holding 8-bit levels stays as it is
    assert (np.asarray(as_image("image", eight, mode)) == 200).all()

def test_a_16_bit_png_control_is_scaled_by_the_servers_decoder():
    levels, image = sixteen_bit_gradient()
    got = pictures.sent_picture("controls[0].image", png64(image), SimpleNamespace(name="m", max_size=64))
    assert got.mode == "RGB" and np.abs(np.asarray(got)[..., 1].astype(int) - np.rint(levels / 257)).max() == 0


def test_an_edits_canny_runs_once_per_request_off_the_loop(client, monkeypatch):
    require("cv2", "canny")
    from stepserve.controls import preprocess

    calls: list = []
    watched(monkeypatch, preprocess, "canny", calls)
    png = base64.b64decode(png64(noise_photo(16)))
    answer = client.post("/v1/images/edits", data={"prompt": "a small cat", "n": "2", "num_inference_steps": "3",
                                                    "size": "16x16", "controls[0][name]": "edge",
                                                    "controls[0][preprocess]": "canny"},
                         files={"image": ("i.png", png), "controls[0][image]": ("c.png", png)})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"]) == 2
    assert [(name, loop) for name, loop, _ in calls] == [("canny", False)]
