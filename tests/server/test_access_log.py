"""One access-log line per image request (method, path, status, outcome, latency, steps, batch sizes), whatever
its outcome; off with access_log=False (`stepserve serve --no-access-log`)."""

from __future__ import annotations

import logging
import re

import httpx

GENERATIONS = "/v1/images/generations"
FAST = {"num_inference_steps": 3, "size": "16x16"}


def access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "stepserve.access"]


def test_each_image_request_logs_one_line_with_its_outcome(serve, caplog):
    caplog.set_level(logging.INFO, logger="stepserve.access")
    with serve(strategy="continuous", max_batch_size=4) as server:
        ok = httpx.post(server.url + GENERATIONS, json={"prompt": "x", "n": 2, "seed": 1, **FAST}, timeout=60)
        bad = httpx.post(server.url + GENERATIONS, json={"prompt": "x", "size": "7x7"}, timeout=60)
        streamed = httpx.post(server.url + GENERATIONS, json={"prompt": "y", "seed": 2, "stream": True, **FAST},
                              timeout=60)
    assert (ok.status_code, bad.status_code, streamed.status_code) == (200, 400, 200)
    lines = access_lines(caplog)
    assert len(lines) == 3, lines
    assert re.fullmatch(r"POST /v1/images/generations 200 completed \d+\.\d{3} s n=2 steps=3 batch=\d-\d", lines[0])
    assert re.fullmatch(r"POST /v1/images/generations 400 invalid \d+\.\d{3} s", lines[1])
    assert re.fullmatch(r"POST /v1/images/generations 200 completed \d+\.\d{3} s n=1 steps=3 batch=\d-\d", lines[2])


def test_an_edit_logs_its_own_path(serve, caplog):
    import io

    from PIL import Image

    caplog.set_level(logging.INFO, logger="stepserve.access")
    image = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 40, 200)).save(image, format="PNG")
    with serve() as server:
        ok = httpx.post(server.url + "/v1/images/edits", files={"image": ("in.png", image.getvalue(), "image/png")},
                        data={"prompt": "x", "num_inference_steps": "4", "strength": "0.5"}, timeout=60)
        bad = httpx.post(server.url + "/v1/images/edits", data={"prompt": "x"}, timeout=60)
    assert (ok.status_code, bad.status_code) == (200, 415), (ok.text, bad.text)  # 415: not multipart
    lines = access_lines(caplog)
    assert re.fullmatch(r"POST /v1/images/edits 200 completed \d+\.\d{3} s n=1 steps=4 batch=\d-\d", lines[0]), lines
    assert re.fullmatch(r"POST /v1/images/edits 415 invalid \d+\.\d{3} s", lines[1]), lines


def test_the_access_log_can_be_turned_off(serve, caplog):
    caplog.set_level(logging.INFO, logger="stepserve.access")
    with serve(access_log=False) as server:
        assert httpx.post(server.url + GENERATIONS, json={"prompt": "x", **FAST}, timeout=60).status_code == 200
    assert access_lines(caplog) == []


def test_serve_has_the_flag_and_logs_its_own_lines_at_the_log_level():
    from stepserve.commands.serve import build_parser, log_to_stderr, serve_settings

    assert serve_settings(build_parser().parse_args(["--no-access-log"])).access_log is False
    assert serve_settings(build_parser().parse_args([])).access_log is True
    logger = logging.getLogger("stepserve")
    level, handlers = logger.level, list(logger.handlers)
    try:
        log_to_stderr("warning")
        log_to_stderr("info")  # a second call changes the level, and adds no second handler
        assert logger.level == logging.INFO
        assert sum(getattr(h, "stepserve_serve", False) for h in logger.handlers) == 1
    finally:
        logger.setLevel(level)
        logger.handlers[:] = handlers
