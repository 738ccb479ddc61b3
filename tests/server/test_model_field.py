"""The body's "model" names a model served here, or the request is answered 404 model_not_found (OpenAI's error
shape, naming the served names), as OpenAI and vLLM answer: another model never stands in for it silently.
`--served-model-name` adds aliases, listed at /v1/models; every endpoint that takes "model" applies the check."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from server_helpers import GENERATIONS, assert_error_shape, decode_png

from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app
from stepserve.server.schemas import ServerLimits

BODY = {"prompt": "seven", "seed": 2, "num_inference_steps": 2, "guidance_scale": 1.0}


@pytest.fixture(scope="module")
def client(tiny_executor):
    limits = ServerLimits(served_model_names=("dall-e-3", "pipe"))  # the model's own name given again: listed once
    with TestClient(create_app(AsyncEngine(tiny_executor, strategy="continuous"), limits=limits)) as c:
        yield c


def not_found(response) -> str:
    error = assert_error_shape(response, 404)
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "served: pipe, dall-e-3" in error["message"], error
    return error["message"]


def test_an_unknown_model_is_404_and_the_served_names_are_one_image(client):
    plain = client.post(GENERATIONS, json=BODY)
    assert plain.status_code == 200, plain.text
    for name in ("pipe", "dall-e-3"):  # the model's own name and an alias: the same model, the same image
        named = client.post(GENERATIONS, json={**BODY, "model": name})
        assert named.status_code == 200, named.text
        assert named.json()["stepserve"]["model"] == "pipe"
        assert decode_png(named.json()["data"][0]["b64_json"]).tobytes() == \
            decode_png(plain.json()["data"][0]["b64_json"]).tobytes()
    other = client.post(GENERATIONS, json={**BODY, "model": "gpt-image-1"})
    assert "'gpt-image-1' is not served here" in not_found(other)
    assert assert_error_shape(client.post(GENERATIONS, json={**BODY, "model": 5}), 400)["param"] == "model"


def test_models_lists_the_aliases_and_finds_each(client):
    listed = client.get("/v1/models").json()
    assert [m["id"] for m in listed["data"]] == ["pipe", "dall-e-3"]
    assert client.get("/v1/models/dall-e-3").json()["id"] == "dall-e-3"
    not_found(client.get("/v1/models/dall-e-2"))


def test_edits_and_async_jobs_check_the_model_before_anything_is_queued(client):
    from test_edits import png

    form = {"prompt": "seven", "model": "dall-e-2", "num_inference_steps": "2"}
    not_found(client.post("/v1/images/edits", data=form, files={"image": ("in.png", png(1), "image/png")}))
    not_found(client.post(GENERATIONS, json={**BODY, "model": "dall-e-2"}, headers={"Prefer": "respond-async"}))
    assert client.get("/v1/images/jobs").json()["data"] == []  # no job was created


def test_videos_check_the_model(wan_executor):
    with TestClient(create_app(AsyncEngine(wan_executor, strategy="continuous"))) as c:
        error = assert_error_shape(c.post("/v1/videos", json={"prompt": "a boat", "model": "sora-2"}), 404)
        assert error["code"] == "model_not_found" and "served: pipe" in error["message"]


def test_served_model_name_flag_reaches_the_limits(capsys):
    from stepserve.commands.serve import build_parser, serve_settings

    args = build_parser().parse_args(["--served-model-name", "dall-e-3", "--served-model-name", "gpt-image-1"])
    assert serve_settings(args).limits.served_model_names == ("dall-e-3", "gpt-image-1")
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--served-model-name", "dall e"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--served-model-name" in err and "without spaces" in err, err
