"""Helpers of the Ray Serve tests (test_ray_serve.py, test_ray_jobs.py): a Ray cluster on loopback in a helper
process, `stepserve serve --replicas ...` as a child process, and every process a test started found again (by a
marker in its environment) and required gone at the end.

The cluster helper also kills replicas for a test: `Cluster.kill(id)` asks Ray to kill the replica's actor,
`Cluster.sigkill(id)` sends SIGKILL to its process (as the kernel's OOM killer or a crash would end it: no code of
the replica runs after it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = "STEPSERVE_RAY_TEST_MARK"

CLUSTER = """
import os, signal, sys, ray
from stepserve.server.ray.processes import adopt_orphans, end_leftovers
adopt_orphans()
ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
for line in sys.stdin:
    how, _, replica = line.strip().rpartition(" ")
    [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + replica)]
    handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
    if how == "sigkill":
        os.kill(ray.get(handle.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)
    else:
        ray.kill(handle, no_restart=False)
    print("killed", flush=True)
ray.shutdown()
end_leftovers()
"""


# Ray Serve gives its HTTP proxy 5 s to say it is ready (10 s per health check) and gives up on the third miss: on a
# machine shared with other test runs that fails `serve.start` now and then. These bound a hang only.
RAY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "120"}


def ray_env(mark: str, **extra: str) -> dict:
    """The environment of the processes a test starts: loopback only, the marker, one OpenMP thread each."""
    from stepserve.server.ray.proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV

    return {**os.environ, "PYTHONPATH": str(ROOT), MARK: mark, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token", PROXY_CALLBACK_ENV: PROXY_CALLBACK,
            "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **RAY_PATIENCE, **extra}


def marked_pids(mark: str) -> list[int]:
    """Processes whose environment carries this marker: everything a test started, Ray's workers included."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        with open(f"/proc/{entry}/stat") as s:
                            if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                                found.append(int(entry))
            except OSError:
                pass
    return found


def assert_all_gone(mark: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while marked_pids(mark) and time.monotonic() < deadline:
        time.sleep(0.25)
    left = marked_pids(mark)
    assert not left, f"processes left behind: {[Path(f'/proc/{p}/cmdline').read_bytes()[:80] for p in left]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A Ray cluster on loopback, run by a helper process (CLUSTER) until close()."""

    def __init__(self, mark: str, env: dict | None = None) -> None:
        self.mark = mark
        self.helper = subprocess.Popen([sys.executable, "-c", CLUSTER], cwd=ROOT, env=env or ray_env(mark),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self.helper.stdout.readline().strip()
        if not self.address:
            self.close()
            raise AssertionError("the test's Ray cluster did not start")

    def kill(self, replica: str) -> None:
        """Ray kills the replica's actor (ray.kill)."""
        self._ask(replica)

    def sigkill(self, replica: str) -> None:
        """SIGKILL to the replica's process."""
        self._ask(f"sigkill {replica}")

    def _ask(self, line: str) -> None:
        self.helper.stdin.write(line + "\n")
        self.helper.stdin.flush()
        answer = self.helper.stdout.readline().strip()
        assert answer == "killed", f"the cluster helper answered {answer!r} to {line!r}"

    def close(self) -> None:
        """Stop the cluster, and require every process started under the marker gone."""
        self.helper.stdin.close()
        self.helper.wait(60)
        assert_all_gone(self.mark)


class ServeProcess:
    """`stepserve serve --replicas ...` as a child process; its log goes to a file (Ray logs a lot)."""

    def __init__(self, mark: str, *flags: str, env: dict | None = None, model: str | None = "embedded") -> None:
        """`model` None: the flags name the models (--models FILE)."""
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="stepserve-ray-", suffix=".log")
        args = [*(("--model", model) if model else ()), "--port", str(self.port), "--threads", "1", "--log-level",
                "warning", "--no-memory-cap", *flags]
        self.proc = subprocess.Popen([sys.executable, "-m", "stepserve.cli", "serve", *args], cwd=ROOT,
                                     env=env or ray_env(mark), stdout=self.log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def text(self) -> str:
        return Path(self.log.name).read_text()

    def tail(self) -> str:
        return self.text()[-3000:]

    def wait_ready(self, timeout_s: float = 600.0) -> None:  # bounds a hang only (a busy machine is slow to start Ray)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"stepserve serve exited early:\n{self.tail()}"
            if "on http://" in self.text():
                return
            time.sleep(0.25)
        raise AssertionError(f"stepserve serve --replicas did not come up:\n{self.tail()}")

    def stop(self) -> int:
        """SIGTERM to the CLI alone, as a process manager would send it; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"stepserve serve did not stop on SIGTERM:\n{self.tail()}") from None
