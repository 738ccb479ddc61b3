"""The videos endpoint on a Wan server: a job's life (queued, in progress, completed; an MP4 of the right frames that
shows WanPipeline's video), its progress as server-sent events, deletion, bad input refused per request; and a
video and image requests served at once by one server, each its own answer. The bounds, overload and each job's
end counted once: test_video_limits.py."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from extras import require
from server_helpers import GENERATIONS, assert_error_shape, decode_png, pixels, wait_until
from step_gate import SteppedExecutor
from video_helpers import as_mp4, client, mp4_frames, wait_done
from wan_reference import reference_video

from stepserve import SamplingParams


def test_a_video_job_from_creation_to_mp4(wan, wan_executor):
    require("imageio_ffmpeg", "video")
    body = {"prompt": "a red fox running", "size": "32x48", "seconds": "0.25", "seed": 11,
            "num_inference_steps": 3, "guidance_scale": 4.0, "negative_prompt": "blurry", "sampler": "flow_euler"}
    with client(wan_executor) as c:
        created = c.post("/v1/videos", json=body)
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["object"] == "video" and job["id"].startswith("video_")
        assert job["status"] in ("queued", "in_progress") and 0 <= job["progress"] < 100
        assert (job["model"], job["size"], job["seconds"]) == ("pipe", "32x48", "0.25")
        assert job["stepserve"]["num_frames"] == 5 and job["stepserve"]["fps"] == 16
        done = wait_done(c, job["id"])
        assert (done["status"], done["progress"], done["error"]) == ("completed", 100, None), done
        content = c.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        assert content.content[4:8] == b"ftyp"
        listed = c.get("/v1/videos").json()
        assert [v["id"] for v in listed["data"]] == [job["id"]]
        deleted = c.delete(f"/v1/videos/{job['id']}").json()
        assert deleted == {"id": job["id"], "object": "video.deleted", "deleted": True}
        assert_error_shape(c.get(f"/v1/videos/{job['id']}"), 404)
    frames = mp4_frames(content.content)
    assert frames.shape == (5, 48, 32, 3)
    p = SamplingParams(prompt=body["prompt"], negative_prompt="blurry", seed=11, num_inference_steps=3,
                       guidance_scale=4.0, sampler="flow_euler", height=48, width=32, num_frames=5)
    want, other = reference_video(wan, p), reference_video(wan, SamplingParams(**{**vars(p), "seed": 12}))
    near, far = np.abs(frames - as_mp4(want)).mean(), np.abs(frames - as_mp4(other)).mean()
    assert near < 0.5 and far > 1, (near, far)


def test_progress_streams_as_server_sent_events(wan_executor):
    require("imageio_ffmpeg", "video")
    with client(wan_executor) as c:
        with c.stream("POST", "/v1/videos", json={"prompt": "a boat", "num_frames": 5, "seed": 2, "stream": True,
                                                  "num_inference_steps": 4, "guidance_scale": 1.0}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [(e.split("\n")[0][len("event: "):], json.loads(e.split("\n")[1][len("data: "):]))
                      for e in r.read().decode().strip().split("\n\n")]
    names = [name for name, _ in events]
    assert names[0] in ("video.queued", "video.in_progress") and names[-1] == "video.completed", names
    progress = [body["progress"] for _, body in events]
    assert progress == sorted(progress) and progress[-1] == 100 and len(set(progress)) >= 3, progress


def test_a_video_and_images_at_once_each_get_their_own_answer(wan, wan_executor):
    """One Wan server: a 5-frame video job and a 1-frame request on /v1/images/generations run in the same engine
    at the same time (in their own (frames, height, width) buckets); the image equals WanPipeline's one-frame
    output, the video its video."""
    require("imageio_ffmpeg", "video")
    steps: list[set] = []
    gate = SteppedExecutor(wan_executor)  # the video's first step waits until the images are queued beside it
    with client(gate) as c:
        engine = c.app.state.server.engine
        engine.on_step.append(lambda report: steps.append({r.params.num_frames for r in report.progressed}))
        video = c.post("/v1/videos", json={"prompt": "a lighthouse", "size": "32x32", "num_frames": 5,
                                           "seed": 3, "num_inference_steps": 30, "guidance_scale": 4.0}).json()
        images = {}

        def post_images():
            images["answer"] = c.post(GENERATIONS, json={"prompt": "seven", "size": "32x32", "n": 2, "seed": 40,
                                                         "num_inference_steps": 3, "guidance_scale": 3.0,
                                                         "negative_prompt": "dark"})

        thread = threading.Thread(target=post_images)
        try:
            assert gate.wait_held(), "the video never reached its first step"
            thread.start()
            assert wait_until(lambda: engine.queue_depth == 2, 240), "the images were never queued"
        finally:
            gate.free()
        thread.join(240)
        done = wait_done(c, video["id"])
        assert done["status"] == "completed", done
        mp4 = c.get(f"/v1/videos/{video['id']}/content").content
    answer = images["answer"]
    assert answer.status_code == 200, answer.text
    video_steps = [i for i, s in enumerate(steps) if 5 in s]
    image_steps = [i for i, s in enumerate(steps) if 1 in s]
    # served at once: the image steps and the video steps interleave (each step runs one bucket)
    assert video_steps[0] < image_steps[-1] and image_steps[0] < video_steps[-1], (video_steps, image_steps)
    for k, item in enumerate(answer.json()["data"]):
        p = SamplingParams(prompt="seven", negative_prompt="dark", seed=40 + k, num_inference_steps=3,
                           guidance_scale=3.0, sampler="dpmpp_2m", height=32, width=32, num_frames=1)
        assert np.abs(pixels(decode_png(item["b64_json"])) - reference_video(wan, p)[0]).max() <= 1
    p = SamplingParams(prompt="a lighthouse", seed=3, num_inference_steps=30, guidance_scale=4.0,
                       sampler="dpmpp_2m", height=32, width=32, num_frames=5)
    assert np.abs(mp4_frames(mp4) - as_mp4(reference_video(wan, p))).mean() < 0.5


@pytest.mark.parametrize("body, param, says", [
    ({"prompt": "a", "num_frames": 4}, "num_frames", "1 + a multiple of 4 from 1 to 9"),
    ({"prompt": "a", "seconds": "2"}, "seconds", "from 0 to 0.5 (9 frames at 16 fps)"),
    ({"prompt": "a", "seconds": 10 ** 400}, "seconds", "from 0 to 0.5"),  # too large for a float: still a 400
    ({"prompt": "a", "seconds": "0.25", "num_frames": 5}, "seconds", "not both"),
    ({"prompt": "a", "sampler": "unipc"}, "sampler", "allowed: dpmpp_2m, flow_euler"),
    ({"prompt": "a", "size": "40x32"}, "size", "multiple of 16"),
    ({"prompt": "a", "fps": 0}, "fps", "from 1 to 60"),
    ({"prompt": "a", "input_reference": "x"}, "input_reference", "not served"),
    ({"prompt": "a", "frames": 5}, "frames", "unknown field"),
])
def test_bad_video_requests_are_400_naming_the_field(wan_executor, body, param, says):
    require("imageio_ffmpeg", "video")
    with client(wan_executor) as c:
        error = assert_error_shape(c.post("/v1/videos", json=body), 400)
    assert error["param"] == param and says in error["message"], error


def test_an_image_model_refuses_videos(tiny_executor):
    with client(tiny_executor) as c:
        error = assert_error_shape(c.post("/v1/videos", json={"prompt": "a", "num_frames": 5}), 400)
    assert error["code"] == "model_not_video" and "makes images, not videos" in error["message"]
