"""What an engine asks of its IP-Adapters at start-up: serve a folder (one adapter per sub-folder, loaded on first
use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def serve_ip_adapters(executor: Any, ip_adapter_dir: str) -> str:
    """Serve the IP-Adapters of `ip_adapter_dir`. A ValueError names the folder, or what this model lacks to serve
    any. Returns a line to log."""
    root = Path(ip_adapter_dir)
    if not root.is_dir():
        raise ValueError(f"ip_adapter_dir {ip_adapter_dir!r} is not a folder")
    if not hasattr(executor, "ip_adapters") or not getattr(executor.pipeline, "runs_controls", False):
        raise ValueError("ip_adapter_dir: IP-Adapters are served for SD 1/2 models on the torch backend, without "
                         "--compile/--deterministic")
    names = sorted(executor.ip_adapters(root).names)
    return f"IP-Adapter: {len(names)} in {root} ({', '.join(names) or 'none yet'}), one loaded at a time on first use"
