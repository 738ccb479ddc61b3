"""Shared by the benchmark scripts (run as `python benchmarks/<script>.py`, so this folder is on sys.path)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pick_model(arg: str) -> str:
    """'auto' -> the embedded model if it is installed, else a tiny random SD pipeline built in a temp folder."""
    from stepserve.pipelines.diffusers_sd import EMBEDDED_PATH

    if arg != "auto":
        return arg
    if (EMBEDDED_PATH / "model_index.json").is_file():
        return "embedded"
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tiny_sd import build_tiny_sd

    return str(build_tiny_sd(Path(tempfile.mkdtemp()) / "tiny"))


def benchmark_sd(arg: str) -> str:
    """'tiny-sd' -> a tiny random SD at benchmark size (UNet widths 64/128, 64x64 images), built in a temp folder;
    anything else is a model folder, kept."""
    if arg != "tiny-sd":
        return arg
    from stepserve.tiny.sd import build_tiny_sd

    return str(build_tiny_sd(Path(tempfile.mkdtemp()) / "sd", channels=(64, 128), sample_size=32))


def rotating_rounds(cases: list, run, rounds: int, warmup: int = 1) -> dict:
    """Each case's seconds per round (`run(case)` returns them), the cases taking turns in a rotating order so that
    none always runs first; the `warmup` first rounds are left out."""
    got: dict = {case: [] for case in cases}
    for n in range(rounds + warmup):
        for case in cases[n % len(cases):] + cases[: n % len(cases)]:
            seconds = run(case)
            if n >= warmup:
                got[case].append(seconds)
    return got


def stepserve(*argv: str) -> None:
    """Run a `stepserve` command in a child process from the repository root; fail loudly if it fails."""
    subprocess.run([sys.executable, "-m", "stepserve.cli", *argv], check=True, cwd=ROOT)


def bench(argv: list[str]) -> None:
    """`stepserve bench` with these arguments, in a child process."""
    stepserve("bench", *argv)


def summaries(path: Path) -> dict[str, dict]:
    """A bench run's summaries (its results.json in `path`) by contender."""
    data = json.loads((path / "results.json").read_text())
    return {s["contender"]: s for s in data["summaries"]}


def percentile_ratios(before: dict, after: dict, labels: tuple[str, str]) -> dict:
    """p50 / p95 / p99 (medians over repeats) of two bench summaries side by side, printed; {key: {label: s, ...,
    "ratio": after / before}}."""
    out = {}
    for key in ("p50_s", "p95_s", "p99_s"):
        x, y = before[key]["median"], after[key]["median"]
        out[key] = {labels[0]: x, labels[1]: y, "ratio": y / x}
        print(f"{key[:-2]:4}: {labels[0]} {x * 1000:7.0f} ms   {labels[1]} {y * 1000:7.0f} ms   ratio {y / x:.2f}")
    return out


def default_threads() -> int:
    """Every core this process may use but one (left to the load generator)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def add_run_args(p: argparse.ArgumentParser, out: str, *, duration_s: float = 30.0, threads: bool = True) -> None:
    """The flags the trace benchmarks share: where results go, the model, the request mix and run lengths that
    they pass on to `stepserve bench`, and the engine's batch bound (and threads)."""
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--model", default="embedded")
    p.add_argument("--steps", default="8,20,40", help="the mix's step counts")
    p.add_argument("--duration", type=float, default=duration_s, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=8, help="the engine's batch bound")
    if threads:
        p.add_argument("--threads", type=int, default=default_threads())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, label: str, timeout_s: float, poll_s: float = 0.2,
                       log: str | None = None) -> None:
    """Poll the server's /health until it answers 200. Exits with a message when the server dies first, or when it
    is not ready within timeout_s (it is stopped then); `log`: where its output went, named in the message."""
    see = f"; see {log}" if log is not None else ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server {label} exited with {proc.returncode} before it was ready{see}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(poll_s)
    stop_server(proc)
    raise SystemExit(f"server {label} did not become ready within {timeout_s:g} s{see}")


def stop_server(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM, and a kill when the server has not exited within grace_s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
