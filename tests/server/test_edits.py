"""POST /v1/images/edits: the official openai client's images.edit works against the server and the image is the
one Engine gives for the same image, prompt, seed and strength; bad images and fields are a 400 naming them."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from stepserve import Engine, SamplingParams
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.loading import load_executor
from stepserve.server.app import create_app


def png(seed: int = 0, size: int = 32) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = np.clip(np.linspace(0, 255, size)[None, :, None] + rng.normal(0, 40, (size, size, 3)), 0, 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(AsyncEngine(load_executor("embedded"), strategy="continuous"))) as c:
        yield c


def test_the_openai_client_edits_an_image(client):
    import base64

    import openai

    api = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client)
    result = api.images.edit(image=("in.png", png(1), "image/png"), prompt="seven", response_format="b64_json",
                             extra_body={"seed": 5, "num_inference_steps": 10, "strength": 0.6})
    got = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    engine = Engine(load_executor("embedded"), strategy="continuous")
    want = engine.generate([SamplingParams(prompt="seven", seed=5, num_inference_steps=10, strength=0.6,
                                           image=Image.open(io.BytesIO(png(1))))])[0]
    assert np.abs(np.asarray(got, np.int16) - np.asarray(want.image, np.int16)).max() <= 1
    assert len(want.timing.batch_sizes) == 6


def alpha_mask(size: int = 32) -> bytes:
    """OpenAI's kind of mask: opaque where the image is kept, transparent where it is edited (the left half)."""
    rgba = np.full((size, size, 4), 255, dtype=np.uint8)
    rgba[:, : size // 2, 3] = 0
    out = io.BytesIO()
    Image.fromarray(rgba, mode="RGBA").save(out, format="PNG")
    return out.getvalue()


def test_the_openai_client_inpaints_with_an_alpha_mask(client):
    import base64

    import openai

    api = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key="unused", http_client=client)
    result = api.images.edit(image=("in.png", png(2), "image/png"), mask=("mask.png", alpha_mask(), "image/png"),
                             prompt="three", response_format="b64_json",
                             extra_body={"seed": 9, "num_inference_steps": 8})
    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))), np.int16)
    white_left = np.zeros((32, 32), dtype=np.uint8)
    white_left[:, :16] = 255  # the same mask in diffusers' convention: white repaints
    engine = Engine(load_executor("embedded"), strategy="continuous")
    want = engine.generate([SamplingParams(prompt="three", seed=9, num_inference_steps=8,
                                           image=Image.open(io.BytesIO(png(2))), mask_image=white_left)])[0]
    assert np.abs(got - np.asarray(want.image, np.int16)).max() <= 1
    assert len(want.timing.batch_sizes) == 8  # the inpaint pipelines' default strength, 1.0


@pytest.mark.parametrize("files,data,status,says", [
    ({"picture": ("a.png", png(), "image/png")}, {"prompt": "seven"}, 400, "image: required"),
    ({"image": ("x.txt", b"not an image", "text/plain")}, {"prompt": "seven"}, 400, "not a PNG, JPEG or WebP"),
    ({"image": ("a.png", png(), "image/png"), "mask": ("m.png", png(size=16), "image/png")}, {"prompt": "seven"},
     400, "mask: is 16x16 (width x height); it must match the image's 32x32"),
    ({"image": ("a.png", png(), "image/png"), "mask": ("m.png", b"GIF89a", "image/gif")}, {"prompt": "seven"}, 400,
     "mask: not a PNG, JPEG or WebP"),
    ({"image": ("a.png", png(), "image/png")}, {"prompt": "seven", "strength": "1.5"}, 400,
     "strength: must be a number in (0, 1]"),
    ({"image": ("a.png", png(), "image/png")}, {"prompt": "seven", "steps": "4"}, 400, "steps: not a field"),
    ({"image": ("a.png", png(size=64), "image/png")}, {"prompt": "seven"}, 400, "64x64"),
])
def test_bad_edits_are_400_naming_the_field(client, files, data, status, says):
    answer = client.post("/v1/images/edits", files=files, data=data)
    assert answer.status_code == status and says in answer.text, answer.text


def test_an_edit_must_be_multipart(client):
    answer = client.post("/v1/images/edits", json={"prompt": "seven"})
    assert answer.status_code == 415 and "multipart/form-data" in answer.text


def test_a_picture_larger_than_the_model_makes_is_resized_to_the_size_asked_for(client):
    """A photo larger than the model makes (but within what the server reads) is not refused when `size` names a
    size the model makes: it is resized to it, as diffusers' img2img pipelines resize their input."""
    answer = client.post("/v1/images/edits", files={"image": ("a.png", png(size=64), "image/png")},
                         data={"prompt": "seven", "size": "32x32", "num_inference_steps": "2"})
    assert answer.status_code == 200, answer.text
    image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
    assert image.size == (32, 32)
