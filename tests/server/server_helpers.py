"""Small helpers shared by the HTTP tests."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time

import numpy as np
from PIL import Image

GENERATIONS = "/v1/images/generations"


def decode_png(b64: str) -> Image.Image:
    raw = base64.b64decode(b64)
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return Image.open(io.BytesIO(raw))


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def assert_close(a, b, tol: int = 1) -> None:
    diff = np.abs(pixels(a) - pixels(b)).max()
    assert diff <= tol, f"images differ by up to {diff} (allowed {tol})"


def assert_error_shape(response, status: int | None = None) -> dict:
    if status is not None:
        assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error


def raw_post(port: int, body: bytes, path: str = GENERATIONS) -> socket.socket:
    """Send a POST by hand and return the open socket (the test decides when to hang up)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + body)
    return sock


def read_headers(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def wait_until(predicate, timeout_s: float, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def up_or_gone(url: str, proc):
    """A wait_until predicate: the server process answers /health with 200, or it has exited (the caller then
    reads why from its stderr)."""
    import httpx

    def check() -> bool:
        try:
            return httpx.get(url + "/health", timeout=30).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    return check


def free_port() -> str:
    """A free loopback port, as a flag value: `serve` binds its port before it loads anything, so a test that runs
    its main() never uses the default 8000 (another server on the machine may hold it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


class ServerThread:
    """uvicorn in a thread, bound to a socket we opened ourselves (so the port is known and never raced)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP proto: asyncio then sets TCP_NODELAY
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
    def engine(self):  # the app's AsyncEngine
        return self.app.state.server.engine

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 240  # bounds a hang only
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()
