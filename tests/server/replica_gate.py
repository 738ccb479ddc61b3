"""The step gate (tests/step_gate.py) for Ray Serve replicas, which a test cannot reach in memory: the test steers
every replica's denoising steps through files in one folder, and each replica reports what it ran there.

Ray runs `install()` in every worker process of the test's cluster (its `worker_process_setup_hook`, named with the
folder in the environment: `hook_env(folder)`). In a replica, the engine's executor is then wrapped as soon as
stepserve's Ray deployment module is imported; other workers (Ray's controller, its proxy) import nothing.

The folder:
- `allow` (written by the test): N. A request that has taken N denoising steps waits before its next one until
  the file is gone or says more. No file: steps run freely.
- `pace` (written by the test): S. A replica starts a denoising step at most every S seconds.
- `<replica id>.json` (written by each replica, atomically): {"held": whether a step waits at the gate now,
  "steps": {request id: denoising steps taken}, "finished": [request ids that ended, any way],
  "aborted": [request ids whose abort was told to the engine]}.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV = "STEPSERVE_TEST_REPLICA_GATE"
TARGET = "stepserve.server.ray.deployment"
HOOK_ENV = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # Ray's worker_process_setup_hook, as its workers read it
POLL_S = 0.005


def hook_env(folder: Path) -> dict[str, str]:
    """The environment that makes every worker of a cluster started with it run `install()` over `folder`."""
    here = Path(__file__).resolve().parent
    return {HOOK_ENV: f"{Path(__file__).stem}.install", ENV: str(folder),
            "PYTHONPATH": f"{here.parents[1]}{os.pathsep}{here}"}


def install() -> None:
    if os.environ.get(ENV) and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Wraps the deployment module's start_engine once the module is loaded."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_wrap(module) -> None:
            exec_module(module)
            module.start_engine = _gated(module.start_engine)

        loader.exec_module = exec_and_wrap
        return spec


def _gated(start_engine):
    def start(config):
        from ray import serve

        engine = start_engine(config)
        gate = FileGate(engine, Path(os.environ[ENV]), serve.get_replica_context().replica_id.unique_id)
        engine.executor = engine.core.executor = gate
        engine.on_step.append(gate.on_step)
        abort = engine.abort

        def told_abort(request_id, *args, **kwargs):
            gate.on_abort(request_id)
            return abort(request_id, *args, **kwargs)

        engine.abort = told_abort
        return engine

    return start


class FileGate:
    def __init__(self, engine: Any, folder: Path, replica: str) -> None:
        self._executor = engine.executor
        self.folder, self.replica = folder, replica
        self.held = False
        self.steps: dict[str, int] = {}
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self._last_start = 0.0
        self._lock = threading.Lock()
        self._report()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)

    def denoise(self, requests):
        while self._must_wait(requests):
            if not self.held:
                self.held = True
                self._report()
            time.sleep(POLL_S)
        if self.held:
            self.held = False
            self._report()
        self._last_start = time.monotonic()
        seconds = self._executor.denoise(requests)
        for r in requests:
            self.steps[r.request_id] = self.steps.get(r.request_id, 0) + 1
        self._report()
        return seconds

    def on_step(self, report) -> None:
        if report.finished:
            self.finished += [r.request_id for r in report.finished]
            self._report()

    def on_abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._report()

    def _must_wait(self, requests) -> bool:
        allow = _read(self.folder / "allow")
        if allow is not None and any(self.steps.get(r.request_id, 0) >= allow for r in requests):
            return True
        pace = _read(self.folder / "pace")
        return pace is not None and time.monotonic() < self._last_start + pace

    def _report(self) -> None:
        with self._lock:
            state = {"held": self.held, "steps": self.steps, "finished": self.finished, "aborted": self.aborted}
            path = self.folder / f"{self.replica}.json"
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(state))
            os.replace(temporary, path)


def _read(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


class Gate:
    """The test's side: steer the replicas and read what each reports."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def allow(self, steps: int) -> None:
        self._write("allow", steps)

    def pace(self, seconds: float) -> None:
        self._write("pace", seconds)

    def free(self) -> None:
        for name in ("allow", "pace"):
            (self.folder / name).unlink(missing_ok=True)

    def forget(self) -> None:
        """Drop the replicas' reports (before a new set of replicas starts)."""
        for path in self.folder.glob("*.json"):
            path.unlink(missing_ok=True)

    def state(self, replica: str) -> dict:
        try:
            return json.loads((self.folder / f"{replica}.json").read_text())
        except (OSError, ValueError):
            return {"held": False, "steps": {}, "finished": [], "aborted": []}

    def wait(self, replica: str, check, timeout_s: float = 240.0) -> dict:
        """The replica's report once `check(report)` holds (timeout_s bounds a hang only)."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state(replica)
            if check(state):
                return state
            assert time.monotonic() < deadline, f"replica {replica} never reported what the test waits for: {state}"
            time.sleep(0.02)

    def wait_any(self, check, timeout_s: float = 240.0) -> tuple[str, dict]:
        """(replica, its report) once `check(report)` holds for some replica (timeout_s bounds a hang only)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for path in self.folder.glob("*.json"):
                state = self.state(path.stem)
                if check(state):
                    return path.stem, state
            assert time.monotonic() < deadline, "no replica ever reported what the test waits for"
            time.sleep(0.02)

    def _write(self, name: str, value: float) -> None:
        temporary = self.folder / f"{name}.tmp"
        temporary.write_text(str(value))
        os.replace(temporary, self.folder / name)
