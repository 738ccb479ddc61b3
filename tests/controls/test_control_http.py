"""ControlNets over HTTP: GET /v1/controlnets lists the folder's (loaded or not); a generation's controls carry
base64 pictures, checked before decoding with the edit images' limits, and the image equals diffusers' pipeline;
bad controls are a 400 naming the field; a body keeps the JSON size limit unless it carries controls."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from control_reference import build_controlnets, diffusers_controlnet, request
from edit_images import start_image
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


def b64(image, fmt="PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def body(controls, **extra):
    return {"prompt": "a small cat 3", "seed": 703, "num_inference_steps": 6, "guidance_scale": 4.0,
            "sampler": "dpmpp_2m", "size": "16x16", "controls": controls, **extra}


def test_listed_then_served_equal_to_diffusers(served, tiny_sd_path):
    client, folder = served
    listed = client.get("/v1/controlnets").json()["data"]
    assert [(c["name"], c["loaded"]) for c in listed] == [("depth", False), ("edge", False), ("pose", False)]
    p = request(3, (("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.3, 1.0)))
    sent = [{"name": c["name"], "image": b64(c["image"]), "scale": c["scale"], "start": c["start"], "end": c["end"]}
            for c in p.controls]
    sent[1]["image"] = "data:image/png;base64," + sent[1]["image"]
    answer = client.post("/v1/images/generations", json=body(sent))
    assert answer.status_code == 200, answer.text
    got = decode_png(answer.json()["data"][0]["b64_json"])
    assert np.abs(pixels(got) - diffusers_controlnet(tiny_sd_path, folder, p)).max() <= 1
    assert answer.json()["stepserve"]["images"][0]["controls"] == [
        {"name": "pose", "scale": 0.8, "start": 0.0, "end": 0.5, "guess_mode": False},
        {"name": "depth", "scale": 1.2, "start": 0.3, "end": 1.0, "guess_mode": False}]
    listed = {c["name"]: c["loaded"] for c in client.get("/v1/controlnets").json()["data"]}
    assert listed == {"depth": True, "edge": False, "pose": True}


@pytest.mark.parametrize("controls,param,says", [
    ([{"name": "pose", "image": "not base64!"}], "controls[0].image", "not base64"),
    ([{"name": "pose", "image": 12}], "controls[0].image", "expected a base64 PNG, JPEG or WebP image"),
    ([{"name": "pose", "image": base64.b64encode(b"plain text").decode()}], "controls[0].image",
     "not a PNG, JPEG or WebP"),
    ([{"name": "pose", "image": b64(Image.new("RGB", (5000, 4)))}], "controls[0].image", "larger than this server"),
    ([{"name": "pose", "image": b64(start_image(1))}, {"name": "depth", "image": b64(start_image(2)), "scale": 11}],
     "controls[1].scale", "must be a number in [0, 10]"),
    ([{"name": "mystery", "image": b64(start_image(1))}], "controls[0].name", "served: depth, edge, pose"),
    ([{"name": "pose", "image": b64(start_image(1)), "start": 1.0}], "controls[0].start", "below end"),
    ([{"name": "pose", "image": b64(start_image(1)), "guess_mode": 1}], "controls[0].guess_mode", "true or false"),
    ([{"name": "pose", "image": b64(start_image(1))}, {"name": "depth", "image": b64(start_image(2)),
                                                       "guess_mode": True}, {"name": "edge", "image":
                                                       b64(start_image(3)), "guess_mode": False}],
     "controls[2].guess_mode", "guess mode is one setting per request"),
])
def test_bad_controls_are_a_400_naming_the_field(served, controls, param, says):
    client, _ = served
    error = assert_error_shape(client.post("/v1/images/generations", json=body(controls)), 400)
    assert error["param"] == param and says in error["message"], error


def test_guess_mode_served_equal_to_diffusers(served, tiny_sd_path):
    client, folder = served
    p = request(6, (("edge", 0.9, 0.0, 1.0), ("pose", 1.1, 0.2, 1.0)), guess=True)
    sent = [{"name": c["name"], "image": b64(c["image"]), "scale": c["scale"], "start": c["start"], "end": c["end"],
             **({"guess_mode": True} if i else {})} for i, c in enumerate(p.controls)]  # one says it: both are
    answer = client.post("/v1/images/generations", json=body(sent, prompt=p.prompt, seed=p.seed))
    assert answer.status_code == 200, answer.text
    got = decode_png(answer.json()["data"][0]["b64_json"])
    assert np.abs(pixels(got) - diffusers_controlnet(tiny_sd_path, folder, p)).max() <= 1
    assert [c["guess_mode"] for c in answer.json()["stepserve"]["images"][0]["controls"]] == [True, True]


def test_controls_lift_the_json_body_limit_and_nothing_else_does(served):
    client, _ = served
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (160, 160, 3), dtype=np.uint8))
    sent = [{"name": "edge", "image": b64(noisy)}]
    assert len(sent[0]["image"]) > 64 * 1024
    assert client.post("/v1/images/generations", json=body(sent)).status_code == 200
    error = assert_error_shape(client.post("/v1/images/generations",
                                           json=body(None, negative_prompt="x" * (70 * 1024))), 413)
    assert "64 KiB" in error["message"]


def test_an_async_request_with_controls_gives_the_synchronous_image(served):
    from jobs.job_helpers import wait_job

    client, _ = served
    sent = body([{"name": "pose", "image": b64(start_image(5)), "scale": 0.9}])
    sync = client.post("/v1/images/generations", json=sent)
    created = client.post("/v1/images/generations", json=sent, headers={"Prefer": "respond-async"})
    assert created.status_code == 202, created.text
    stored = client.app.state.server.jobs.store.get_job(created.json()["id"])
    # the picture is an input file, as an edit's are: not base64 in the job's document
    assert stored.request["body"]["controls"][0]["image"] == "" and list(stored.request["inputs"]) == ["controls-0"]
    done = wait_job(client, f"/v1/images/jobs/{created.json()['id']}")
    assert done["status"] == "completed", done
    assert done["result"]["data"][0]["b64_json"] == sync.json()["data"][0]["b64_json"]
    assert done["result"]["stepserve"]["images"][0]["controls"][0]["name"] == "pose"


def test_a_flux_model_serves_its_controlnets_over_http(tmp_path):
    """The same route for a Flux.1 model: its ControlNets listed, and an image equal to FluxControlNetPipeline."""
    from stepserve.tiny.flux import build_tiny_flux

    pipe = build_tiny_flux(tmp_path / "flux")
    folder = build_controlnets(pipe, tmp_path / "controlnets")
    built = build_engine(EngineConfig(model=str(pipe), memory_cap=False, warm_up=False, controlnet_dir=str(folder),
                                      options=EngineOptions(strategy="continuous")), say=lambda _: None)
    with TestClient(create_app(AsyncEngine(built.executor, options=built.options))) as client:
        assert [c["name"] for c in client.get("/v1/controlnets").json()["data"]] == ["depth", "edge", "pose"]
        p = request(4, (("edge", 0.9, 0.0, 0.8),), sampler="flow_euler", steps=4)
        sent = [{"name": "edge", "image": b64(p.controls[0]["image"]), "scale": 0.9, "start": 0.0, "end": 0.8}]
        answer = client.post("/v1/images/generations", json=body(sent, prompt=p.prompt, seed=p.seed,
                                                                 sampler="flow_euler", num_inference_steps=4))
        assert answer.status_code == 200, answer.text
        got = decode_png(answer.json()["data"][0]["b64_json"])
    assert np.abs(pixels(got) - diffusers_controlnet(pipe, folder, p, "flux")).max() <= 1
