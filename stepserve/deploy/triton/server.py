"""Runs the tritonserver binary that ships with nvidia-pytriton (Python backend only) on a model repository.

What it needs, found by trial on Linux:
- a backend directory with python/ holding libtriton_python.so, triton_python_backend_utils.py and the stub
  built for this Python (pytriton ships stubs per version; they are linked, not copied, so their relative
  library path keeps working);
- LD_LIBRARY_PATH with this Python's own lib/ first (the stub links libpython and would otherwise take the
  system's) and pytriton's bundled libraries;
- this Python's bin/ first on PATH: the stub's embedded interpreter finds its prefix, and so a virtual
  environment's site-packages (numpy, stepserve), through the `python3` it finds there. It ignores PYTHONPATH.
  Without it the stub imports the base interpreter's packages (a numpy it was not built for garbles tensors).

The server and its stub processes run in their own process group; stop() ends that group and removes the
Python backend's shared-memory regions.

    python3 -m stepserve.deploy.triton.server REPO [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ...util.api_key import resolve_api_key
from ...util.interrupts import handle_sigterm_as_ctrl_c
from ...util.ports import free_ports

STOP_TIMEOUT_S = 20.0


STUB_TIMEOUT_S = 600  # seconds a python-backend model's stub may take to start or answer


class TritonServerError(RuntimeError):
    """tritonserver could not be found, started, or did not become ready."""


@dataclass(frozen=True)
class Ports:
    http: int
    grpc: int
    metrics: int


def pytriton_dir() -> Path:
    """The tritonserver folder inside the installed nvidia-pytriton."""
    try:
        import pytriton
    except ImportError:
        raise TritonServerError("nvidia-pytriton is not installed; it carries the tritonserver binary used here "
                                "(pip install nvidia-pytriton), or run a Triton container on the repository") from None
    folder = Path(pytriton.__file__).resolve().parent / "tritonserver"
    if not (folder / "bin" / "tritonserver").is_file():
        raise TritonServerError(f"{folder}: no bin/tritonserver in this nvidia-pytriton installation")
    return folder


def backend_dir(server: Path, into: Path) -> Path:
    """A backend directory for the Python backend with the stub for this interpreter's version."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (server / "python_backend_stubs").iterdir())
        raise TritonServerError(f"nvidia-pytriton has no Python backend stub for Python {version}; it has "
                                f"{', '.join(have)}")
    python = into / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (server / "backends" / "python" / "libtriton_python.so",
                   server / "backends" / "python" / "triton_python_backend_utils.py", stub):
        (python / source.name).symlink_to(source)
    return into


def server_env(server: Path) -> dict[str, str]:
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(server.parent.parent / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in [*libs, env.get("LD_LIBRARY_PATH", "")] if p)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")  # torch in each stub runs samplers only; onnxruntime sizes its own pool
    return env


class TritonServer:
    """tritonserver on `repository`, bound to 127.0.0.1 ports (free ones unless given). Use as a context manager,
    or start() / stop()."""

    def __init__(self, repository: str | os.PathLike, ports: Ports | None = None, log_file: str | None = None,
                 host: str = "127.0.0.1", quiet: bool = False, api_key: str | None = None) -> None:
        self.repository = Path(repository).resolve()
        self.ports = ports or Ports(*free_ports(3))
        self.host = host
        self.quiet = quiet
        self.workdir = Path(tempfile.mkdtemp(prefix="stepserve-triton-"))
        self.log_path = Path(log_file) if log_file else self.workdir / "tritonserver.log"
        self.shm_prefix = f"stepserve-triton-{os.getpid()}-{secrets.token_hex(3)}-"
        self.process: subprocess.Popen | None = None
        self.keep_log = log_file is not None  # a temporary log is kept only when start() failed (its error cites it)
        self.api_key = api_key  # required as 'authorization: Bearer KEY' on every API but health (restricted_flags)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    def _say(self, message: str) -> None:
        if not self.quiet:
            print(f"triton: {message}", flush=True)

    def command(self) -> list[str]:
        server = pytriton_dir()
        backends = backend_dir(server, self.workdir / "backends")
        return [str(server / "bin" / "tritonserver"), f"--model-repository={self.repository}",
                f"--backend-directory={backends}", f"--http-address={self.host}", f"--grpc-address={self.host}",
                f"--metrics-address={self.host}", f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}",
                f"--metrics-port={self.ports.metrics}", "--exit-timeout-secs=10",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                # the python backend gives each model's stub 30 s to answer by default; loading a pipeline on a busy
                # CPU takes longer, and a stub that overruns it aborts the whole server (boost lock_exception)
                f"--backend-config=python,stub-timeout-seconds={STUB_TIMEOUT_S}", *restricted_flags(self.api_key)]

    def start(self, timeout_s: float = 600.0) -> TritonServer:  # a slow, shared machine loads models for minutes
        command = self.command()
        self._say(f"starting tritonserver on {self.repository} (http {self.http_url}, grpc {self.grpc_url}, "
                  f"log {self.log_path})")
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=server_env(Path(command[0]).parent.parent), start_new_session=True)
        try:
            self._wait_ready(timeout_s)
        except BaseException as e:
            self.keep_log = not isinstance(e, KeyboardInterrupt)  # an error cites the log; Ctrl-C/SIGTERM: no trace
            self.stop()
            raise
        self._say(f"ready in {time.monotonic() - started:.1f} s")
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TritonServerError(f"tritonserver exited with code {self.process.returncode} while starting; "
                                        f"the end of its log ({self.log_path}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise TritonServerError(f"tritonserver was not ready within {timeout_s:g} s; the end of its log "
                                f"({self.log_path}):\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the server's process group (its stubs) if it has not ended in time."""
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self._say("tritonserver did not stop in time; killing it and its stub processes")
            try:
                os.killpg(process.pid, signal.SIGKILL)  # the group is the server's own (start_new_session)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)
        shutil.rmtree(self.workdir / "backends", ignore_errors=True)
        if not self.keep_log or self.log_path.parent != self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


RESTRICTED_APIS = "metadata,inference,shared-memory,model-config,model-repository,statistics,trace,logging"


def restricted_flags(api_key: str | None) -> list[str]:
    """tritonserver's own key check, on HTTP and gRPC: every API but health needs 'authorization: Bearer KEY'.
    (tritonserver takes the key on its command line; the launcher's own does not show it.)"""
    if api_key is None:
        return []
    rule = f"{RESTRICTED_APIS}:authorization=Bearer {api_key}"
    return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m stepserve.deploy.triton.server",
                                description="Serve a repository written by `stepserve export triton` with the "
                                            "tritonserver that ships with nvidia-pytriton, until Ctrl-C.")
    p.add_argument("repository", help="the model repository folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--log-file", default=None, help="tritonserver's log (default: a file in a temporary folder)")
    p.add_argument("--api-key", default=None, help="require 'authorization: Bearer KEY' (visible in `ps`; prefer "
                                                   "--api-key-file or STEPSERVE_API_KEY)")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file")
    args = p.parse_args(argv)
    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
    except ValueError as exc:
        print(f"triton: error: {exc}", file=sys.stderr)
        return 2
    if not Path(args.repository).is_dir():
        print(f"triton: error: repository {args.repository!r} is not a folder", file=sys.stderr)
        return 2
    server = TritonServer(args.repository, Ports(args.http_port, args.grpc_port, args.metrics_port), args.log_file,
                          args.host, api_key=api_key)
    try:
        handle_sigterm_as_ctrl_c()  # `kill`, `docker stop`: tritonserver, its stubs and folder go as on Ctrl-C
        server.start()
        print(f"triton: serving; Ctrl-C or SIGTERM stops (log {server.log_path})", flush=True)
        while server.process is not None and server.process.poll() is None:
            time.sleep(0.5)
        return 0 if server.process is None else server.process.returncode or 1
    except TritonServerError as e:
        print(f"triton: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
