"""Where the models that share one device live, by use: a pure policy (the memory manager that follows it is
engine/device.py).

A model is on the device (it can step), in host memory (offloaded: it moves back before its next step, much faster
than loading) or on disk (not loaded: its next use loads it). The device has a budget for all models together
(--device-memory-mb), and so has host memory. When a model needs room on the device, the idle models there move to
host memory, least recently used first, never one with requests in flight (`busy`); when host memory is over its
budget, its idle models go back to disk, least recently used first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEVICE, HOST, DISK = "device", "host", "disk"
PLACES = (DEVICE, HOST, DISK)


@dataclass(frozen=True)
class Placed:
    """What the policy knows of one model: where it is, its size, when it was last used, whether it is busy."""

    model: str
    place: str  # DEVICE, HOST or DISK
    nbytes: int  # its weights (measured once loaded; estimated from its files before)
    last_used: float  # the caller's clock
    busy: bool = False  # requests in flight: it never moves


def used(models: Sequence[Placed], place: str) -> int:
    return sum(m.nbytes for m in models if m.place == place)


def make_room(models: Sequence[Placed], place: str, need: int, budget: int | None,
              keep: str | None = None) -> list[str] | None:
    """The models to move out of `place` so that `need` more bytes fit within `budget` there: idle ones, least
    recently used first, never `keep` (the one the room is for). [] when it fits already; None when even moving
    every idle model out would not make it fit (the caller waits or refuses)."""
    if budget is None:
        return []
    over = used(models, place) + need - budget
    if over <= 0:
        return []
    out: list[str] = []
    for m in sorted((m for m in models if m.place == place and not m.busy and m.model != keep),
                    key=lambda m: (m.last_used, m.model)):
        out.append(m.model)
        over -= m.nbytes
        if over <= 0:
            return out
    return None


def too_large(nbytes: int, budget: int | None) -> bool:
    """A model larger than the whole budget never fits, however much moves out."""
    return budget is not None and nbytes > budget
