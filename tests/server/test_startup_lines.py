"""What `stepserve serve` says when it is up: where the API is and where the console is (the web page at /); a
video model without the `video` extra says at start-up that POST /v1/videos will answer 501, naming the pip
command, before any work is sent."""

from __future__ import annotations

import sys

import pytest

from server_helpers import free_port


def serve_until_ready(argv: list[str], monkeypatch, capsys) -> str:
    """Run `stepserve serve` in process up to the point where uvicorn would serve; its stderr."""
    from stepserve.cli import main
    from stepserve.server.draining import DrainingServer

    ran = []
    monkeypatch.setattr(DrainingServer, "run", lambda self, sockets: ran.append(sockets))
    assert main(["serve", "--no-memory-cap", *argv]) == 0
    assert len(ran) == 1  # it got as far as serving
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan_start") / "pipe")


def test_a_video_model_without_the_video_extra_says_so_at_start_up(wan, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # as if the extra were not installed
    port = free_port()
    err = serve_until_ready(["--model", str(wan), "--port", port], monkeypatch, capsys)
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1, err
    assert "pip install 'stepserve[video]'" in warnings[0] and "POST /v1/videos answers 501" in warnings[0]
    assert f"console: http://127.0.0.1:{port}/" in err


def test_the_ready_line_names_the_api_and_the_console(monkeypatch, capsys):
    port = free_port()
    err = serve_until_ready(["--port", port, "--strategy", "continuous"], monkeypatch, capsys)
    ready = [line for line in err.splitlines() if "console:" in line]
    assert len(ready) == 1, err
    assert f"on http://127.0.0.1:{port}/v1 (" in ready[0] and ready[0].endswith(f"console: http://127.0.0.1:{port}/")
    assert "warning" not in err  # an image model has no video extra to miss


def test_an_any_address_host_is_shown_as_localhost():
    from stepserve.server.startup import base_url

    assert base_url("0.0.0.0", 8000) == "http://localhost:8000"
    assert base_url("::", 8000) == "http://localhost:8000"
    assert base_url("::1", 8000) == "http://[::1]:8000"
    assert base_url("10.1.2.3", 80) == "http://10.1.2.3:80"
