"""Moving a loaded model between its device and host memory (a server of several models, engine/device.py).

Every torch network a pipeline holds (its own, its family networks', its add-ons' in their stores) moves with
`.to()`; the prompt caches, which hold encoder outputs on the device, are emptied. On a CPU device host memory is
the device: nothing moves, and only the server's accounting changes. A model that is not on its device runs no
step: the server moves it back inside the step's turn, before the step.
"""

from __future__ import annotations

from typing import Any

import torch

from ..scheduling.residency import DEVICE, HOST


def networks_of(root: Any, depth: int = 3) -> list[torch.nn.Module]:
    """The torch modules reachable from `root`'s attributes (and their attributes, `depth` levels down), each
    once: a pipeline's networks, its family's network bundle, the add-on stores' loaded ControlNets."""
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()

    def walk(obj: Any, level: int) -> None:
        if id(obj) in seen or level > depth:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found.setdefault(id(obj), obj)
            return
        if isinstance(obj, dict):
            values = list(obj.values())
        elif isinstance(obj, (list, tuple)):
            values = list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            values = list(vars(obj).values())
        else:
            return
        for value in values:
            if not isinstance(value, (str, bytes, int, float, bool, torch.Tensor)) and value is not None:
                walk(value, level + 1)

    walk(root, 0)
    return list(found.values())


def place(executor: Any, where: str) -> None:
    """Move `executor`'s model to host memory (HOST) or back to its device (DEVICE), under its stage lock (no step
    and no add-on load runs meanwhile). A CPU device: nothing to move."""
    if where not in (HOST, DEVICE):
        raise ValueError(f"where must be {HOST!r} or {DEVICE!r}, got {where!r}")
    device = torch.device(executor.device)
    if device.type == "cpu":
        return
    target = torch.device("cpu") if where == HOST else device
    with executor.lock:
        for module in networks_of(executor):
            module.to(target)
        pipeline = executor.pipeline
        pipeline.prompt_cache.clear()
        for cache in getattr(pipeline, "_adapter_caches", {}).values():
            cache.clear()
        if where == HOST and device.type == "cuda":
            torch.cuda.empty_cache()


def weight_bytes(executor: Any) -> int:
    """The bytes of a loaded model's weights and buffers (every network it holds)."""
    total = 0
    for module in networks_of(executor):
        total += sum(t.numel() * t.element_size() for t in module.parameters())
        total += sum(t.numel() * t.element_size() for t in module.buffers())
    return total
