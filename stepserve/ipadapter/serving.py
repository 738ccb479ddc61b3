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
    if not hasattr(executor, "ip_adapters") or not executor.pipeline.runs_ip_adapters:
        from ..capabilities import where_served

        raise ValueError(f"ip_adapter_dir: IP-Adapters are served for {where_served('ip_adapter')}")
    store = executor.ip_adapters(root)
    store.budget_bytes = None if memory_mb is None else int(memory_mb * 2**20)
    names = sorted(store.names)
    room = "" if memory_mb is None else f" within {memory_mb:g} MiB"
    return f"IP-Adapter: {len(names)} in {root} ({', '.join(names) or 'none yet'}), loaded on first use{room}"


def to_load(executor: Any, params) -> list[list[str]]:
    """Per request, the served IP-Adapters it names that are not loaded now (requests naming none, or more than a
    request may, are left out). `params` as resolved (the HTTP, edit and job paths: ImagePrompt objects) or as sent
    (the Python API: a dict or a list of them, before any check). Cheap: on the event loop."""

    store = getattr(executor, "_ip_adapters", None)
    if store is None:
        return []
    out = []
    for p in params:
        names = _names(p, store)
        if any(n not in store.loaded for n in names):
            out.append(names)
    return out


def _names(p, store) -> list[str]:
    """The served IP-Adapters one request names (resolved, or as sent: up to MAX_PROMPTS, else none)."""
    from .spec import MAX_PROMPTS

    prompts = getattr(p, "ip_adapter", None)
    items = [prompts] if isinstance(prompts, dict) else prompts if isinstance(prompts, (list, tuple)) else []
    if not items or len(items) > MAX_PROMPTS:
        return []
    said = (i.get("name") if isinstance(i, dict) else getattr(i, "name", None) for i in items)
    return [n for n in dict.fromkeys(said) if isinstance(n, str) and n in store.names]


def hold(executor: Any, owner, params) -> None:
    """`owner` (a request until it ends, or an addons.store.Holder until released) holds the served IP-Adapters
    these requests name, as controls/serving.hold does the ControlNets."""
    store = getattr(executor, "_ip_adapters", None)
    if store is None:
        return
    names = {n for p in params for n in _names(p, store)}
    if names:
        store.budget.hold(owner, sorted(names))


def release(executor: Any, owner) -> None:
    store = getattr(executor, "_ip_adapters", None)
    if store is not None:
        store.budget.release(owner)


def load(executor: Any, groups: list[list[str]]) -> None:
    """Load each request's adapters, together (a thread of the front end's own). One that cannot be loaded (now)
    is left to the request's first step, which fails that request alone with the reason."""
    from .parts import IPAdapterError

    store = executor.ip_adapters()
    for names in groups:
        for name in names:
            try:
                store.ensure(name, keep=names)
            except IPAdapterError:
                pass
