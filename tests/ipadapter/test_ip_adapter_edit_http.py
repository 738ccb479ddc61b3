"""Image prompts on `POST /v1/images/edits`: the image prompt as multipart form parts (ip_adapter[name], an
ip_adapter[image] file, ip_adapter[scale]); the image equals diffusers' Img2Img / Inpaint pipeline with the
IP-Adapter, an edit job gives the synchronous image, and a part that does not fit the scheme, or a picture too
large or unreadable, is a 400 naming the part."""

from __future__ import annotations

import io

import numpy as np
import pytest
from edit_images import mask_image, start_image
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


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def an_edit(i=3, mask=True, scale=0.7):
    p = request(i, "face", scale)
    p.image, p.strength, p.mask_image = start_image(i), 0.75, mask_image(i) if mask else None
    return p


def edit_form(p):
    """(the form's files, its text fields) for request `p` (an edit with an image prompt), the prompt as parts."""
    files = [("image", ("a.png", png(p.image), "image/png")),
             ("ip_adapter[image]", ("ip.png", png(p.ip_adapter["image"]), "image/png"))]
    if p.mask_image is not None:
        files.append(("mask", ("m.png", png(p.mask_image), "image/png")))
    data = {"prompt": p.prompt, "seed": str(p.seed), "num_inference_steps": str(p.num_inference_steps),
            "guidance_scale": str(p.guidance_scale), "sampler": p.sampler, "size": f"{p.width}x{p.height}",
            "strength": str(p.strength), "ip_adapter[name]": p.ip_adapter["name"],
            "ip_adapter[scale]": str(p.ip_adapter["scale"])}
    return files, data


@pytest.mark.parametrize("mask", [False, True])
def test_a_multipart_edit_with_image_prompt_parts_equals_diffusers(served, tiny_sd_path, mask):
    client, folder = served
    p = an_edit(mask=mask)
    files, data = edit_form(p)
    answer = client.post("/v1/images/edits", files=files, data=data)
    assert answer.status_code == 200, answer.text
    got = decode_png(answer.json()["data"][0]["b64_json"])
    assert np.abs(pixels(got) - diffusers_ip_adapter(tiny_sd_path, folder, p)).max() <= 1
    assert answer.json()["stepserve"]["images"][0]["ip_adapter"] == {"name": "face", "scale": 0.7}
    plain = client.post("/v1/images/edits", files=files[:1] + files[2:],
                        data={k: v for k, v in data.items() if not k.startswith("ip_adapter")})
    assert np.abs(pixels(decode_png(plain.json()["data"][0]["b64_json"])) - pixels(got)).max() > 4


def test_an_edit_job_with_an_image_prompt_gives_the_synchronous_image(served):
    from jobs.job_helpers import wait_job

    client, _ = served
    files, data = edit_form(an_edit(5))
    sync = client.post("/v1/images/edits", files=files, data=data)
    assert sync.status_code == 200, sync.text
    created = client.post("/v1/images/edits", files=files, data=data, headers={"Prefer": "respond-async"})
    assert created.status_code == 202, created.text
    done = wait_job(client, f"/v1/images/jobs/{created.json()['id']}")
    assert done["status"] == "completed", done
    assert done["result"]["data"][0]["b64_json"] == sync.json()["data"][0]["b64_json"]
    assert done["result"]["stepserve"]["images"][0]["ip_adapter"] == {"name": "face", "scale": 0.7}


def _huge() -> bytes:
    return png(Image.new("RGB", (5000, 16)))  # a small file whose header says 5000 pixels wide


def _picture(data: bytes):
    return lambda f, d: f.__setitem__(1, ("ip_adapter[image]", ("ip.png", data, "image/png")))


@pytest.mark.parametrize("change,param,says", [
    (lambda f, d: d.update({"ip_adapter": '{"name": "face"}'}), "ip_adapter", "as form parts, not a JSON object"),
    (lambda f, d: d.update({"ip_adapter[image]": "x"}) or f.pop(1), "ip_adapter[image]", "an image file"),
    (lambda f, d: f.pop(1), "ip_adapter[image]", "required with an image prompt"),
    (lambda f, d: d.pop("ip_adapter[name]"), "ip_adapter[name]", "required with an image prompt"),
    (lambda f, d: d.update({"ip_adapter[scale]": "big"}), "ip_adapter[scale]", "not a number"),
    (lambda f, d: d.update({"ip_adapter[weight]": "1"}), "ip_adapter[weight]", "not an image prompt's part"),
    (lambda f, d: d.update({"ip_adapter[name]": "nope"}), "ip_adapter.name", "served: face, style"),
    (lambda f, d: d.update({"ip_adapter[scale]": "-1"}), "ip_adapter.scale", "must be a number in [0, 10]"),
    (_picture(_huge()), "ip_adapter[image]", "5000x16 (width x height) is larger than this server reads"),
    (_picture(b"not a picture"), "ip_adapter[image]", "not a PNG, JPEG or WebP image"),
    (_picture(png(start_image(1))[:80]), "ip_adapter[image]", "its pixels could not be decoded"),
])
def test_bad_image_prompt_parts_are_a_400_naming_the_part(served, change, param, says):
    client, _ = served
    files, data = edit_form(an_edit(mask=False))
    change(files, data)
    error = assert_error_shape(client.post("/v1/images/edits", files=files, data=data), 400)
    assert error["param"] == param and says in error["message"], error
