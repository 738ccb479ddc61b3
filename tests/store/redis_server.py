"""A real redis-server for the tests (no mock stands in for Redis): started on a free loopback port with its files
in a temporary folder, stopped afterwards.

- `redis_url`: a session fixture, the URL of one server for the whole run. Without Debian's `redis-server` or the
  `redis` package it skips with the reason, and under CI=true it fails instead (`.ci/run` installs both).
  Use it from another folder with `from store.redis_server import redis_url  # noqa: F401` (a fixture); give each
  test its own key prefix (RedisStore(url, prefix=...)) rather than flushing what others use.
- `running_redis(folder, *args)`: the same without pytest, for a server of a test's own (extra redis-server
  arguments, e.g. `--requirepass`) and for benchmarks/store_cost.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

BINARY = os.environ.get("STEPSERVE_REDIS_SERVER", "redis-server")
START_BOUND_S = 60.0  # a hang bound only: a server answers as soon as it listens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    """True once the server on `port` answers PING (an inline command: RESP needs no client here)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
        return reply.startswith((b"+PONG", b"-NOAUTH"))  # a server with --requirepass answers too
    except OSError:
        return False


@contextmanager
def running_redis(folder: Path, *args: str, binary: str = BINARY) -> Iterator[str]:
    """A redis-server on 127.0.0.1 with no persistence, its files (log, any dump) in `folder`; yields its URL
    (redis://127.0.0.1:PORT/0) once it answers, and stops it afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "redis.log"
    for _ in range(5):  # a port found free may be taken before the server binds it: try another
        port = _free_port()
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--logfile", str(log), *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_BOUND_S
        while process.poll() is None and not _answers(port) and time.monotonic() < deadline:
            time.sleep(0.02)
        if process.poll() is None and _answers(port):
            break
        process.kill()
        process.wait()
    else:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        raise RuntimeError(f"redis-server did not start on a free loopback port:\n{tail}")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _unavailable(message: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; CI installs it, so this fails instead of skipping")
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    try:
        import redis  # noqa: F401
    except ImportError:
        _unavailable("the redis package is missing: install stepserve[redis] (make test does)")
    binary = shutil.which(BINARY)
    if binary is None:
        _unavailable(f"no {BINARY} on PATH: install Debian's redis-server package (.ci/run does)")
    with running_redis(tmp_path_factory.mktemp("redis"), binary=binary) as url:
        yield url
