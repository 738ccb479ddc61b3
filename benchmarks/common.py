"""Shared by the benchmark scripts (run as `python benchmarks/<script>.py`, so this folder is on sys.path)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
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


def stepserve(*argv: str) -> None:
    """Run a `stepserve` command in a child process from the repository root; fail loudly if it fails."""
    subprocess.run([sys.executable, "-m", "stepserve.cli", *argv], check=True, cwd=ROOT)
