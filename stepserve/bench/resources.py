"""Utilisation while a run is going (process CPU; the GPU through NVML when one is there) and the environment
that results.json records so that a number can be traced back to what produced it."""

from __future__ import annotations

import logging
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata

from .logs import warn_once
from .metrics import Usage

log = logging.getLogger(__name__)


class UsageMonitor:
    """start() ... stop() -> Usage. The process CPU covers every thread (the in-process engine included)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self._nvml = _nvml_handle()
        self._gpu_util: list[float] = []
        self._gpu_mem: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "UsageMonitor":
        self._t0 = time.monotonic()
        self._cpu0 = _cpu_seconds()
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._sample, name="bench-nvml", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        import pynvml

        while not self._stop.wait(self.interval_s):
            try:
                self._gpu_util.append(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu / 100.0)
                self._gpu_mem.append(pynvml.nvmlDeviceGetMemoryInfo(self._nvml).used / 2**20)
            except pynvml.NVMLError as exc:
                warn_once(log, "a GPU utilisation sample failed and was skipped", exc)

    def stop(self) -> Usage:
        wall = time.monotonic() - self._t0
        cpu = _cpu_seconds() - self._cpu0
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        cores = os.cpu_count() or 1
        return Usage(
            cpu_util=cpu / (wall * cores) if wall > 0 else None,
            cpu_cores_used=cpu / wall if wall > 0 else None,
            gpu_util=sum(self._gpu_util) / len(self._gpu_util) if self._gpu_util else None,
            gpu_mem_mib=max(self._gpu_mem) if self._gpu_mem else None,
        )


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _nvml_handle():
    """NVML's handle of GPU 0, or None (no pynvml, no driver, no GPU): then GPU numbers are simply absent."""
    try:
        import pynvml
    except ImportError:
        log.debug("pynvml is not installed: GPU utilisation and memory are not recorded")
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
        return pynvml.nvmlDeviceGetHandleByIndex(0)
    except pynvml.NVMLError as exc:
        warn_once(log, "NVML is not usable: GPU utilisation and memory are not recorded", exc, logging.INFO)
        return None


@dataclass
class Environment:
    command: str
    python: str
    platform: str
    cpu: str
    cpu_count: int
    torch_threads: int | None
    device: str
    gpu: str | None
    versions: dict[str, str] = field(default_factory=dict)
    git_commit: str | None = None
    started_at: str = ""


PACKAGES = ("stepserve", "torch", "diffusers", "transformers", "numpy", "aiohttp", "fastapi", "uvicorn")


def capture_environment(argv: list[str], device: str) -> Environment:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    threads = gpu = None
    try:
        import torch
    except ImportError:  # torch is optional for an HTTP-only run
        log.debug("torch is not installed: torch threads and the GPU name are not recorded")
    else:
        threads = torch.get_num_threads()
        try:
            if torch.cuda.is_available():
                gpu = torch.cuda.get_device_name(0)
        except RuntimeError as exc:  # a CUDA driver or device error
            warn_once(log, "the GPU name is not recorded", exc)
    return Environment(
        command=shlex.join(["stepserve", *argv]), python=sys.version.split()[0], platform=platform.platform(),
        cpu=_cpu_name(), cpu_count=os.cpu_count() or 1, torch_threads=threads, device=device, gpu=gpu,
        versions=versions, git_commit=git_commit(), started_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    """The checkout's commit the code runs from (None: not a git checkout, or git did not run)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError) as exc:  # no git on PATH, or it hung
        warn_once(log, "git did not run: results.json records no git commit", exc)
        return None
    if out.returncode != 0:  # not a git checkout (an installed package)
        log.debug("no git commit recorded: %s", out.stderr.strip())
    return out.stdout.strip() or None
