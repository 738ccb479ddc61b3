"""A peer server as a child process, and making sure that stopping it leaves nothing behind.

Peers start helpers of their own: Ray a GCS, a raylet, a proxy, a controller and worker processes; LitServe an API
server and inference workers (which outlive a SIGTERM to the parent); tritonserver its Python-backend stubs. Some
of them start new sessions or are re-parented, so neither the child's process group nor its process tree finds
them all. Every process of a peer therefore inherits a tag in its environment (STEPSERVE_PEER_TAG); stop() sends
SIGTERM to the child, waits, then SIGKILLs the group and every process that still carries the tag, and checks
that none is left (Linux: /proc/<pid>/environ).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

TAG_ENV = "STEPSERVE_PEER_TAG"
STOP_GRACE_S = 20.0  # Ray's serve.shutdown() + ray.shutdown() take several seconds
KILL_WAIT_S = 10.0


class PeerError(RuntimeError):
    """A peer did not start, or did not stop cleanly."""


def tagged_pids(tag: str) -> list[int]:
    """Live processes (not zombies) whose environment carries TAG_ENV=tag; processes of other users are unreadable
    and skipped."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    if not Path("/proc").is_dir():  # not Linux: only the child's process group is stopped
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # gone meanwhile, or not ours
            continue
        if state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def url_ready(url: str) -> Callable[[], bool]:
    """A readiness probe: GET url answers 200."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    return probe


def file_ready(path: Path) -> Callable[[], bool]:
    """A readiness probe: the peer writes `path` once it serves."""
    return path.exists


class PeerProcess:
    """start() runs `argv` in its own session with the tag and waits until `ready()`; stop() ends it and all it
    started, and raises PeerError if anything survives a SIGKILL."""

    def __init__(self, name: str, argv: list[str], ready: Callable[[], bool], log_path: Path,
                 env: dict[str, str] | None = None, start_timeout_s: float = 660.0) -> None:
        self.name, self.argv, self.ready, self.log_path = name, argv, ready, Path(log_path)
        self.env = env or {}
        self.start_timeout_s = start_timeout_s
        self.tag = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.process: subprocess.Popen | None = None
        self._cancelled = threading.Event()
        self._launching = threading.Lock()

    def start(self) -> PeerProcess:
        env = {**os.environ, **self.env, TAG_ENV: self.tag}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._launching, open(self.log_path, "ab") as log:
            self._check_cancelled()
            self.process = process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not self.ready():
                self._check_cancelled()
                if process.poll() is not None:
                    raise PeerError(f"{self.name} exited with code {process.returncode} while starting; the "
                                    f"end of its log ({self.log_path}):\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise PeerError(f"{self.name} was not ready within {self.start_timeout_s:g} s; the end of its "
                                    f"log ({self.log_path}):\n{self.log_tail()}")
                self._cancelled.wait(0.2)
            self._check_cancelled()
        except BaseException:
            self.stop()
            raise
        return self

    def cancel(self) -> None:
        """From another thread, while start() runs there (Ctrl-C or SIGTERM during start-up): start() gives up
        within one readiness probe, stops what it started and raises PeerError; a start() not begun never launches."""
        with self._launching:
            self._cancelled.set()

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise PeerError(f"{self.name}: start-up interrupted")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the child (a peer shuts down its own helpers), then SIGKILL to its group and to every tagged
        process; PeerError names what is still alive after that."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # the peer's own shutdown first (Ray: serve and ray shutdown)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + KILL_WAIT_S
        while (left := tagged_pids(self.tag)) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        if left:
            raise PeerError(f"{self.name}: processes {left} (tag {self.tag}) survived SIGKILL")

    def __enter__(self) -> PeerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the group is the child's own (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
