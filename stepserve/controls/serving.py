"""What an engine asks of its ControlNets: serve a folder at start-up, and load what a request names before it is
queued (the front end, off its event loop), so that no step waits for a load; the executor's store does the
rest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def serve_controlnets(executor: Any, controlnet_dir: str, memory_mb: float | None) -> str:
    """Serve the ControlNets of `controlnet_dir` (one diffusers ControlNet folder per name), loaded on first use
    within `memory_mb`. A ValueError names the folder, or what this model lacks to serve any. Returns a line to
    log."""
    root = Path(controlnet_dir)
    if not root.is_dir():
        raise ValueError(f"controlnet_dir {controlnet_dir!r} is not a folder")
    if not hasattr(executor, "controlnets") or not executor.pipeline.runs_controls:
        from ..capabilities import where_served

        raise ValueError(f"controlnet_dir: {executor.pipeline.info.name} ({executor.pipeline.family} family) runs no "
                         f"ControlNets here; they are served for {where_served('controlnets')}")
    budget = None if memory_mb is None else int(memory_mb * 2**20)
    store = executor.controlnets(root, budget)
    names = sorted(store.names)
    return (f"ControlNet: {len(names)} in {root} ({', '.join(names) or 'none yet'}), loaded on first use within "
            f"{'no bound' if budget is None else f'{memory_mb:g} MiB'}")


def _served(executor: Any, params) -> tuple[Any, list[str]]:
    """(the executor's ControlNet store or None, the served ControlNets these requests name)."""
    store = getattr(executor, "_controlnets", None)
    if store is None:
        return None, []
    names = [_name(c) for p in params if isinstance(getattr(p, "controls", None), (list, tuple)) for c in p.controls]
    return store, sorted({n for n in names if isinstance(n, str) and n in store.names})


def hold(executor: Any, owner, params) -> None:
    """`owner` (a request until it ends, or an addons.store.Holder until released) holds the served ControlNets
    these requests name: none is unloaded for another meanwhile, so what the front end loads before queueing is
    still loaded at the request's first step (no load on the engine thread)."""
    store, names = _served(executor, params)
    if store is not None and names:
        store.budget.hold(owner, names)


def release(executor: Any, owner) -> None:
    store = getattr(executor, "_controlnets", None)
    if store is not None:
        store.budget.release(owner)


def to_load(executor: Any, params) -> list[str]:
    """The served ControlNets these requests name that are not loaded now. `params` as resolved (the HTTP, edit
    and job paths: Control objects) or as sent (the Python API: dicts, before any check: what validation refuses
    is left out). Cheap: on the event loop."""
    store, names = _served(executor, params)
    return [] if store is None else [n for n in names if n not in store.loaded]


DEPTH = ("num_layers", "num_single_layers")  # a transformer ControlNet's config: how many block outputs it gives


def check_depths(executor: Any, params) -> None:
    """Refuse a request that names ControlNets of different depths (ControlNetError naming them): its controls are
    summed output by output, which such cannot be. Read from their configs (a UNet ControlNet's structure is the
    UNet's, checked at load). Before the request is queued, so it never fails in a step."""
    store = getattr(executor, "_controlnets", None)
    if store is None:
        return
    from .errors import ControlNetError
    from .spec import different_depths

    for p in params:
        controls = getattr(p, "controls", None)
        if not isinstance(controls, (list, tuple)) or len(controls) < 2:
            continue
        names = [n for n in dict.fromkeys(map(_name, controls)) if isinstance(n, str) and n in store.names]
        depths = {n: d for n in names if (d := _depth(store, n)) is not None}  # unreadable: its load says why
        if len(set(depths.values())) > 1:
            raise ControlNetError(different_depths(names, {n: [(k, v) for k, v in zip(DEPTH, d) if v is not None]
                                                           for n, d in depths.items()}))


def _depth(store: Any, name: str) -> tuple | None:
    loaded = store.loaded.get(name)
    if loaded is not None:
        config = loaded.module.config
    else:
        try:
            config = json.loads((store.files()[name] / "config.json").read_text())
        except (KeyError, OSError, ValueError):
            return None
    return tuple(config.get(k) for k in DEPTH)


def _name(item: Any) -> object:
    """A control's name, resolved (controls/spec.Control) or as sent (a dict)."""
    return item.get("name") if isinstance(item, dict) else getattr(item, "name", None)


def load(executor: Any, names: list[str]) -> None:
    """Load `names` (a thread of the front end's own). A ControlNet that cannot be loaded is left to the request's
    first step, which fails that request alone with the reason."""
    from .errors import ControlNetError

    try:
        executor.controlnets().ensure(names)
    except ControlNetError:
        pass
