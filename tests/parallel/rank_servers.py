"""`stepserve serve` at a parallel degree, as a child process: its worker ranks, its readiness and its log lines,
for the tests of a split model's failures and HTTP surface."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
HANG_S = 300  # bounds a hang only: every wait below is on an event


def free_port() -> str:
    """A free loopback port, as a flag value."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


_BUILT: dict[str, Path] = {}


def tiny_flux(tmp_path_factory) -> Path:
    """A tiny random Flux.1 folder (2 attention heads), built once per test session."""
    from stepserve.tiny.flux import build_tiny_flux

    key = str(tmp_path_factory.getbasetemp())
    if key not in _BUILT:
        _BUILT[key] = build_tiny_flux(tmp_path_factory.mktemp("flux_ranks") / "pipe")
    return _BUILT[key]


class RankServer:
    """`python -m stepserve.cli serve --model MODEL --threads 1 ...` on a free port; `ready` is set once the app
    has started (or the process ended), `lines` holds its stderr."""

    def __init__(self, model, *extra: str, new_session: bool = False) -> None:
        self.port = int(free_port())
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stepserve.cli", "serve", "--model", str(model), "--port", str(self.port),
             "--threads", "1", "--no-memory-cap", "--strategy", "continuous", "--log-level", "info", *extra],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=new_session)  # a process group of its own, for a signal to all of it
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._said = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            with self._said:
                self.lines.append(line)
                self._said.notify_all()
            if "Application startup complete" in line:
                self.ready.set()
        self.ready.set()  # the process ended
        with self._said:
            self._said.notify_all()

    def wait_for(self, text: str) -> bool:
        """Whether the server's log says `text` (waiting for it while the server runs, within the hang bound)."""
        with self._said:
            return self._said.wait_for(lambda: any(text in line for line in self.lines) or self.proc.poll()
                                       is not None, HANG_S) and any(text in line for line in self.lines)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "RankServer":
        assert self.ready.wait(HANG_S) and self.proc.poll() is None, "".join(self.lines[-30:])
        return self

    def workers(self) -> list[int]:
        """The worker ranks' pids (the server's child processes)."""
        return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(HANG_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def gone(pid: int) -> bool:
    """The process ended (a zombie waiting for its reaper counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int]) -> bool:
    """Whether every one of `pids` ended, waiting for it within the hang bound (not psutil.wait_procs: it waits
    out its timeout on a zombie another process has not reaped yet)."""
    deadline = time.monotonic() + HANG_S
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return all(gone(pid) for pid in pids)


def kids() -> set[int]:
    """This process's child processes now. Other tests of the session may have left theirs (a store's server): a
    test compares with the set it saw before it started anything."""
    return {c.pid for c in psutil.Process().children(recursive=True)}
