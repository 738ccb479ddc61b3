"""ControlNets of different depths (a transformer ControlNet's num_layers and num_single_layers): a Flux.1 one
without single-stream blocks equals diffusers' pipeline; requests using ControlNets of different depths share one
forward (each ControlNet's outputs spread over the transformer's blocks as the transformer spreads a lone one's),
with no step split, each image the one it gets alone; a request naming two of different depths is refused before it
is queued (over HTTP a 400 naming both), never a failure in a step."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from control_reference import diffusers_controlnet, request
from edit_images import pixels, start_image
from fastapi.testclient import TestClient

from stepserve import Engine
from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

DEPTHS = {"full": None, "half": (1, 1), "nosingle": (1, 0)}  # the transformer has (2, 2) blocks


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from stepserve.tiny.controlnet import build_tiny_controlnet
    from stepserve.tiny.flux import build_tiny_flux

    root = tmp_path_factory.mktemp("control_depths")
    pipe = build_tiny_flux(root / "pipe", layers=(2, 2))
    for seed, (name, depth) in enumerate(DEPTHS.items(), start=1):
        build_tiny_controlnet(pipe, root / "controlnets" / name, seed=seed, std=0.05, depth=depth)
    return pipe, root / "controlnets"


def ask(i, controls, steps=3):
    return request(i, controls, sampler="flow_euler", steps=steps)


def test_a_controlnet_without_single_blocks_equals_diffusers(flux):
    pipe, folder = flux
    engine = Engine.from_pretrained(str(pipe), controlnet_dir=str(folder))
    p = ask(1, (("nosingle", 0.9, 0.0, 1.0),))
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_controlnet(pipe, folder, p, "flux")).max() <= 1


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """A tiny SD3 of six blocks (the last takes no ControlNet output) and ControlNets of four, two and one: SD3
    spreads them by int(k / (blocks / n)), not Flux's k // ceil(blocks / n) (block 3 takes output 2 of four, not
    1)."""
    from stepserve.tiny.controlnet import build_tiny_controlnet
    from stepserve.tiny.sd3 import build_tiny_sd3

    root = tmp_path_factory.mktemp("control_depths_sd3")
    pipe = build_tiny_sd3(root / "pipe", layers=6)
    for seed, (name, depth) in enumerate({"full": (4,), "half": (1,), "nosingle": (2,)}.items(), start=1):
        build_tiny_controlnet(pipe, root / "controlnets" / name, seed=seed, std=0.5, depth=depth)
    return pipe, root / "controlnets"


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_requests_of_different_depths_share_each_step(family, request):
    pipe, folder = request.getfixturevalue(family)
    engine = Engine.from_pretrained(str(pipe), strategy="static", static_batch_size=3, max_batch_size=3,
                                    controlnet_dir=str(folder))
    reqs = [ask(2, (("full", 1.0, 0.0, 1.0),)), ask(3, (("half", 0.8, 0.0, 1.0),)),
            ask(4, (("nosingle", 1.2, 0.0, 1.0),))]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert all(r.ok for r in together), [r.error for r in together]
    assert all(r.timing.batch_sizes == [3] * 3 for r in together)  # one forward per step, never split
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def png64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_one_request_naming_two_depths_is_a_400_naming_both(flux):
    pipe, folder = flux
    engine = Engine.from_pretrained(str(pipe), controlnet_dir=str(folder))
    with TestClient(create_app(AsyncEngine(engine.executor, options=engine.options))) as client:
        body = {"prompt": "a small cat", "num_inference_steps": 2, "size": "16x16", "sampler": "flow_euler",
                "controls": [{"name": "full", "image": png64(start_image(1))},
                             {"name": "half", "image": png64(start_image(2))}]}
        answer = client.post("/v1/images/generations", json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "controls" and "full" in error["message"] and "half" in error["message"]
        assert "same depth" in error["message"]
        body["controls"] = body["controls"][:1]
        assert client.post("/v1/images/generations", json=body).status_code == 200
        bad_cache = client.post("/v1/images/generations", json={**body, "cache": "bogus"})  # read with the controls
        assert bad_cache.status_code == 400 and bad_cache.json()["error"]["param"] == "cache", bad_cache.text
