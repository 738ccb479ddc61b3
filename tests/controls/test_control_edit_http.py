"""ControlNets on `POST /v1/images/edits`: each control as multipart form parts (controls[i][name], a
controls[i][image] file, controls[i][scale], [start], [end], [guess_mode]); the image equals diffusers' ControlNet Img2Img /
Inpaint pipeline, an edit job gives the synchronous image, and a part that does not fit the scheme, or a control
image too large or unreadable, is a 400 naming the part."""

from __future__ import annotations

import io

import numpy as np
import pytest
from control_reference import build_controlnets, diffusers_controlnet, request
from edit_images import mask_image, start_image
from fastapi.testclient import TestClient
from PIL import Image

from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.server.app import create_app
from server.server_helpers import assert_error_shape, decode_png, pixels


@pytest.fixture(scope="module")
def served(tiny_sd_path, tmp_path_factory):
    folder = build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))
    built = build_engine(EngineConfig(model=str(tiny_sd_path), memory_cap=False, warm_up=False,
                                      controlnet_dir=str(folder), options=EngineOptions(strategy="continuous")),
                         say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        yield client, folder


def png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def edit_form(p, controls=None):
    """(the form's files, its text fields) for request `p` (an edit with controls), each control as parts."""
    files = [("image", ("a.png", png(p.image), "image/png"))]
    if p.mask_image is not None:
        files.append(("mask", ("m.png", png(p.mask_image), "image/png")))
    data = {"prompt": p.prompt, "seed": str(p.seed), "num_inference_steps": str(p.num_inference_steps),
            "guidance_scale": str(p.guidance_scale), "sampler": p.sampler, "size": f"{p.width}x{p.height}",
            "strength": str(p.strength)}
    for i, c in enumerate(p.controls if controls is None else controls):
        files.append((f"controls[{i}][image]", (f"c{i}.png", png(c["image"]), "image/png")))
        data.update({f"controls[{i}][{k}]": str(c[k]) for k in ("name", "scale", "start", "end")})
        if "guess_mode" in c:
            data[f"controls[{i}][guess_mode]"] = "true" if c["guess_mode"] else "false"
    return files, data


def an_edit(i=3, mask=True, guess=None):
    p = request(i, (("pose", 0.8, 0.0, 0.6), ("depth", 1.2, 0.3, 1.0)), guess=guess)
    p.image, p.strength, p.mask_image = start_image(i), 0.75, mask_image(i) if mask else None
    return p


@pytest.mark.parametrize("mask,guess", [(False, None), (True, None), (False, True)])
def test_a_multipart_edit_with_control_parts_equals_diffusers(served, tiny_sd_path, mask, guess):
    client, folder = served
    p = an_edit(mask=mask, guess=guess)
    files, data = edit_form(p)
    answer = client.post("/v1/images/edits", files=files, data=data)
    assert answer.status_code == 200, answer.text
    got = decode_png(answer.json()["data"][0]["b64_json"])
    assert np.abs(pixels(got) - diffusers_controlnet(tiny_sd_path, folder, p)).max() <= 1
    guessed = bool(guess)
    assert answer.json()["stepserve"]["images"][0]["controls"] == [
        {"name": "pose", "scale": 0.8, "start": 0.0, "end": 0.6, "guess_mode": guessed},
        {"name": "depth", "scale": 1.2, "start": 0.3, "end": 1.0, "guess_mode": guessed}]


def test_an_edit_job_with_controls_gives_the_synchronous_image(served):
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


def _bad(change):
    """An edit's form with `change(files, data)` applied."""
    files, data = edit_form(an_edit(mask=False))
    change(files, data)
    return files, data


def _huge() -> bytes:
    return png(Image.new("RGB", (5000, 16)))  # a small file whose header says 5000 pixels wide


@pytest.mark.parametrize("change,param,says", [
    (lambda f, d: d.update({"controls": '[{"name": "pose"}]'}), "controls", "as form parts, not a JSON list"),
    (lambda f, d: d.update({"controls[0][image]": "x"}) or f.pop(1), "controls[0][image]", "an image file"),
    (lambda f, d: f.pop(1), "controls[0][image]", "required with controls[0]"),
    (lambda f, d: d.pop("controls[0][name]"), "controls[0][name]", "required with controls[0]"),
    (lambda f, d: d.update({"controls[0][scale]": "big"}), "controls[0][scale]", "not a number"),
    (lambda f, d: d.update({"controls[0][weight]": "1"}), "controls[0][weight]", "not a control's part"),
    (lambda f, d: d.update({"controls[0][guess_mode]": "yes"}), "controls[0][guess_mode]", "allowed: true or false"),
    (lambda f, d: d.update({"controls[3][name]": "edge"}), "controls[2]", "from 0 without gaps"),
    (lambda f, d: d.update({"controls[5][name]": "edge"}), "controls[5][name]", "at most 4 controls"),
    (lambda f, d: d.update({"controls[1][name]": "nope"}), "controls[1].name", "served: depth, edge, pose"),
    (lambda f, d: d.update({"controls[1][scale]": "-1"}), "controls[1].scale", "must be a number in [0, 10]"),
    (lambda f, d: f.__setitem__(1, ("controls[0][image]", ("c.png", _huge(), "image/png"))), "controls[0][image]",
     "5000x16 (width x height) is larger than this server reads"),
    (lambda f, d: f.__setitem__(1, ("controls[0][image]", ("c.png", b"not a picture", "image/png"))),
     "controls[0][image]", "not a PNG, JPEG or WebP image"),
    (lambda f, d: f.__setitem__(1, ("controls[0][image]", ("c.png", png(start_image(1))[:80], "image/png"))),
     "controls[0][image]", "its pixels could not be decoded"),
])
def test_bad_control_parts_are_a_400_naming_the_part(served, change, param, says):
    client, _ = served
    files, data = _bad(change)
    error = assert_error_shape(client.post("/v1/images/edits", files=files, data=data), 400)
    assert error["param"] == param and says in error["message"], error
