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
    if not hasattr(executor, "ip_adapters") or not getattr(executor.pipeline, "runs_ip_adapters", False):
        raise ValueError("ip_adapter_dir: IP-Adapters are served for SD 1/2 and SDXL models on the torch backend, "
                         "without --compile/--deterministic")
    names = sorted(executor.ip_adapters(root).names)
    return f"IP-Adapter: {len(names)} in {root} ({', '.join(names) or 'none yet'}), one loaded at a time on first use"


def to_load(executor: Any, params) -> str | None:
    """The served IP-Adapter these requests name (before any check) that is not loaded now, if it may be loaded
    now (the loaded one serves no request in flight). Cheap: on the event loop."""
    store = getattr(executor, "_ip_adapters", None)
    if store is None:
        return None
    names = {p.ip_adapter.get("name") for p in params if isinstance(getattr(p, "ip_adapter", None), dict)}
    names = sorted(n for n in names if isinstance(n, str) and n in store.names)
    loaded = store.loaded
    if len(names) != 1 or (loaded is not None and (loaded.name == names[0] or loaded.name in store.in_use())):
        return None
    return names[0]


def load(executor: Any, name: str) -> None:
    """Load `name` (a thread of the front end's own). One that cannot be loaded (now) is left to the request's
    first step, which fails that request alone with the reason."""
    from .store import IPAdapterError

    try:
        executor.ip_adapters().ensure(name)
    except IPAdapterError:
        pass
