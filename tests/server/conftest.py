"""Fixtures for the HTTP tests: the real app served by uvicorn on a free loopback port, in a background thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from stepserve.async_engine import AsyncEngine


class ServerThread:
    """uvicorn in a thread, bound to a socket we opened ourselves (so the port is known and never raced)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self) -> AsyncEngine:
        return self.app.state.server.engine

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="session")
def tiny_executor(tiny_sd_path):
    from stepserve.api import load_executor

    return load_executor(str(tiny_sd_path))


@pytest.fixture(scope="session")
def serve(tiny_executor):
    """serve(strategy=..., max_batch_size=..., max_queue=..., api_key=..., limits=...) -> context manager."""
    from stepserve.server import create_app

    @contextlib.contextmanager
    def start(api_key=None, limits=None, shutdown_grace_s=5.0, executor=None, **engine_options):
        engine = AsyncEngine(executor or tiny_executor, **engine_options)
        app = create_app(engine, api_key=api_key, limits=limits, shutdown_grace_s=shutdown_grace_s)
        with ServerThread(app) as server:
            yield server

    return start
