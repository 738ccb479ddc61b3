"""What an engine asks of its IP-Adapters at start-up: serve a folder (one adapter per sub-folder, loaded on first
use)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def serve_ip_adapters(executor: Any, ip_adapter_dir: str, memory_mb: float | None = None) -> str:
    """Serve the IP-Adapters of `ip_adapter_dir`, those loaded within `memory_mb` (None: no bound). A ValueError
    names the folder, or what this model lacks to serve any. Returns a line to log."""
    root = Path(ip_adapter_dir)
    if not root.is_dir():
        raise ValueError(f"ip_adapter_dir {ip_adapter_dir!r} is not a folder")
    if not hasattr(executor, "ip_adapters") or not getattr(executor.pipeline, "runs_ip_adapters", False):
        raise ValueError("ip_adapter_dir: IP-Adapters are served for SD 1/2 and SDXL models on the torch backend, "
                         "without --compile/--deterministic")
    store = executor.ip_adapters(root)
    store.budget_bytes = None if memory_mb is None else int(memory_mb * 2**20)
    names = sorted(store.names)
    room = "" if memory_mb is None else f" within {memory_mb:g} MiB"
    return f"IP-Adapter: {len(names)} in {root} ({', '.join(names) or 'none yet'}), loaded on first use{room}"


def to_load(executor: Any, params) -> list[str]:
    """The served IP-Adapters these requests name (before any check) that are not loaded now. Cheap: on the event
    loop."""
    store = getattr(executor, "_ip_adapters", None)
    if store is None:
        return []
    names = set()
    for p in params:
        prompts = getattr(p, "ip_adapter", None)
        for item in [prompts] if isinstance(prompts, dict) else prompts if isinstance(prompts, list) else ():
            if isinstance(item, dict):
                names.add(item.get("name"))
    return sorted(n for n in names if isinstance(n, str) and n in store.names and n not in store.loaded)


def load(executor: Any, names: list[str]) -> None:
    """Load `names` (a thread of the front end's own). One that cannot be loaded (now) is left to the request's
    first step, which fails that request alone with the reason."""
    from .store import IPAdapterError

    for name in names:
        try:
            executor.ip_adapters().ensure(name)
        except IPAdapterError:
            pass
