"""The official openai client's videos API against a real server (uvicorn) on a tiny Wan model: create (a
multipart form, as the client sends it), retrieve, create_and_poll, download_content, list and delete; and the form
read as strictly as the JSON body (and, on a keyless server, refused from another site's page)."""

from __future__ import annotations

import warnings

import pytest

from conftest import ServerThread
from extras import require
from server_helpers import assert_error_shape
from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app

QUICK = {"num_inference_steps": 2, "seed": 3}  # sent as form fields: the client merges extra_body into its form


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory):
    require("imageio_ffmpeg", "video")
    from stepserve.engine.loading import load_executor
    from stepserve.tiny.wan import build_tiny_wan

    executor = load_executor(str(build_tiny_wan(tmp_path_factory.mktemp("wan_openai") / "pipe")))
    app = create_app(AsyncEngine(executor, strategy="continuous", max_batch_size=4))
    with ServerThread(app) as server:
        yield server


@pytest.fixture()
def api(wan_server):
    import openai

    warnings.filterwarnings("ignore", category=DeprecationWarning)  # the client marks its videos API deprecated
    return openai.OpenAI(base_url=wan_server.url + "/v1", api_key="unused", max_retries=0)


def test_the_openai_client_creates_polls_downloads_lists_and_deletes_videos(api):
    created = api.videos.create(prompt="a red fox running", seconds="0.25", size="32x48", extra_body=QUICK)
    assert created.object == "video" and created.status in ("queued", "in_progress"), created
    assert (created.size, created.seconds) == ("32x48", "0.25")
    assert created.model_extra["stepserve"]["num_frames"] == 5 and created.model_extra["stepserve"]["seed"] == 3
    done = api.videos.poll(created.id, poll_interval_ms=20)
    assert (done.status, done.progress, done.error) == ("completed", 100, None), done
    assert api.videos.retrieve(created.id).status == "completed"
    other = api.videos.create_and_poll(prompt="a boat", extra_body={**QUICK, "num_frames": 1}, poll_interval_ms=20)
    assert other.status == "completed" and other.model_extra["stepserve"]["num_frames"] == 1, other
    mp4 = api.videos.download_content(created.id).content
    assert mp4[4:8] == b"ftyp" and len(mp4) > 100
    assert [v.id for v in api.videos.list()] == [other.id, created.id]  # newest first
    deleted = api.videos.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    assert [v.id for v in api.videos.list()] == [other.id]
    api.videos.delete(other.id)


def test_the_form_is_as_strict_as_the_json_body(api, wan_server):
    import httpx
    import openai

    for extra, param, says in (
        ({"frames": 5}, "frames", "unknown field 'frames'"),
        ({"num_frames": "five"}, "num_frames", "is not a JSON value"),
        ({"num_frames": 4}, "num_frames", "1 + a multiple of 4"),
        ({"stream": "yes"}, "stream", "is not a JSON value"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            api.videos.create(prompt="a", extra_body={**QUICK, **extra})
        error = refused.value.body
        assert error["param"] == param and says in error["message"], error
    with pytest.raises(openai.BadRequestError) as refused:  # image to video: the client uploads a file
        api.videos.create(prompt="a", input_reference=("ref.png", b"\x89PNG", "image/png"), extra_body=QUICK)
    assert refused.value.body["param"] == "input_reference" and "not served" in refused.value.body["message"]
    answer = httpx.post(wan_server.url + "/v1/videos", content=b"prompt=a", timeout=30,
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    error = assert_error_shape(answer, 415)
    assert "application/json" in error["message"] and "multipart/form-data" in error["message"], error
    twice = httpx.post(wan_server.url + "/v1/videos", files={"x": (None, "")}, timeout=30,
                       data={"prompt": ["a", "b"]})
    assert assert_error_shape(twice, 400)["param"] == "prompt" and "more than once" in twice.text
    cross_site = httpx.post(wan_server.url + "/v1/videos", data={"prompt": "a"}, files={"x": (None, "")},
                            headers={"Origin": "https://evil.example"}, timeout=30)
    assert assert_error_shape(cross_site, 403)["code"] == "cross_site_request"  # a keyless server, as edits
