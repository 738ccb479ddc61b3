"""Fixtures for the HTTP tests: the real app served by uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from server_helpers import ServerThread

from stepserve.engine.async_engine import AsyncEngine


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread while these tests run: the server shares 2 cores with its own client threads (and with
    whatever else runs on the machine), and oversubscribed OpenMP threads make tiny-model steps many times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_executor(tiny_sd_path):
    from stepserve.engine.loading import load_executor

    return load_executor(str(tiny_sd_path))


@pytest.fixture(scope="session")
def serve(tiny_executor):
    """serve(strategy=..., max_batch_size=..., max_queue=..., api_key=..., limits=...) -> context manager."""
    from stepserve.server.app import create_app

    @contextlib.contextmanager
    def start(api_key=None, limits=None, shutdown_grace_s=5.0, executor=None, access_log=True, **engine_options):
        engine = AsyncEngine(executor or tiny_executor, **engine_options)
        app = create_app(engine, api_key=api_key, limits=limits, shutdown_grace_s=shutdown_grace_s,
                         access_log=access_log)
        with ServerThread(app) as server:
            yield server

    return start


@pytest.fixture(scope="session")
def wan(tmp_path_factory):
    """A tiny random Wan pipeline folder (the video endpoint's tests)."""
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan_http") / "pipe")


@pytest.fixture(scope="session")
def wan_executor(wan):
    from stepserve.engine.loading import load_executor

    return load_executor(str(wan))


SIGTERM_TEST = "test_sigterm_finishes_in_flight_refuses_new_and_exits_0"


class CliServer:
    """`python -m stepserve.cli serve ...` as a child process on a free port (or, with `launcher`, that script given
    the same flags, e.g. gated_serve.py: its stdin is then a pipe the test writes to)."""

    def __init__(self, model_path, *extra: str, launcher: Path | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": str(root), "TOKENIZERS_PARALLELISM": "false"}
        args = ["--model", str(model_path), "--port", str(self.port), "--threads", "1", "--log-level", "warning",
                *extra]
        command = ["-m", "stepserve.cli", "serve"] if launcher is None else [str(launcher)]
        self.proc = subprocess.Popen([sys.executable, *command, *args], cwd=root, env=env,
                                     stdin=subprocess.PIPE if launcher is not None else None,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture(scope="session", autouse=True)
def early_cli_server(request, tiny_sd_path):
    """The SIGTERM test needs a server process; start it when the session starts, so that its imports and model
    load overlap with the other tests instead of adding to the run time."""
    if not any(item.name == SIGTERM_TEST for item in request.session.items):
        yield None
        return
    # one request per step, each step held until the test frees them; the grace only bounds a hang
    server = CliServer(tiny_sd_path, "--max-batch-size", "1", "--shutdown-grace-s", "600",
                       launcher=Path(__file__).with_name("gated_serve.py"))
    yield server
    server.stop()
