"""A command run as a real process for signal tests: every process it starts inherits a tag in its environment
and its temporary folders go to a folder of the test's, so a test can check that nothing is left behind."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG_ENV = "STEPSERVE_TEST_RUN"


class Command:
    def __init__(self, argv: list[str], tmp_path: Path, module: str = "stepserve.cli") -> None:
        self.tag = secrets.token_hex(6)
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", TAG_ENV: self.tag,
               "TMPDIR": str(self.tmpdir)}
        self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready, timeout_s: float) -> bool:
        """Until ready() (or the process ended, or the time is up); True when ready."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if ready():
                return True
            time.sleep(0.1)
        return False

    def terminate_and_wait(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM, then the exit status (None if still running after timeout_s) and how long it took."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        self._reader.join(5)
        return code, time.monotonic() - t0

    def processes(self) -> list[int]:
        return tagged(self.tag)

    def clean_up(self) -> None:
        """What a failed test must not leave for the next ones."""
        for pid in [self.proc.pid, *tagged(self.tag)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def tagged(tag: str, env: str = TAG_ENV) -> list[int]:
    """Live (not zombie) processes whose environment carries env=tag."""
    needle = f"{env}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def gone_within(pids_of, timeout_s: float) -> list[int]:
    """Waits until pids_of() is empty; returns what is still there after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (left := pids_of()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
