"""What an engine asks of its ControlNets at start-up: serve a folder (the executor's store does the rest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def serve_controlnets(executor: Any, controlnet_dir: str, memory_mb: float | None) -> str:
    """Serve the ControlNets of `controlnet_dir` (one diffusers ControlNet folder per name), loaded on first use
    within `memory_mb`. A ValueError names the folder, or what this model lacks to serve any. Returns a line to
    log."""
    root = Path(controlnet_dir)
    if not root.is_dir():
        raise ValueError(f"controlnet_dir {controlnet_dir!r} is not a folder")
    if not hasattr(executor, "controlnets") or not getattr(executor.pipeline, "runs_controls", False):
        raise ValueError("controlnet_dir: ControlNets are served for SD 1/2 models on the torch backend, without "
                         "--compile/--deterministic")
    budget = None if memory_mb is None else int(memory_mb * 2**20)
    store = executor.controlnets(root, budget)
    names = sorted(store.names)
    return (f"ControlNet: {len(names)} in {root} ({', '.join(names) or 'none yet'}), loaded on first use within "
            f"{'no bound' if budget is None else f'{memory_mb:g} MiB'}")
