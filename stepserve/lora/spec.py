"""A request's `loras` field -> a tuple of (adapter name, scale), checked against the adapters the model serves
(ModelInfo.lora_names). Pure data: no torch.

Accepted: None or [] (no adapter), or a list of {"name": str, "scale": number} (scale defaults to 1.0), at most
MAX_PER_REQUEST, each name once. Several adapters add up, weighted by their scales, as diffusers' set_adapters
weights them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .errors import not_loaded

MAX_PER_REQUEST = 8
MAX_SCALE = 8.0


class LoraSpecError(ValueError):
    """What is wrong with a `loras` value; validation.py reports it as a ValidationError on field "loras"."""


def parse_loras(value: object, known: frozenset[str]) -> tuple[tuple[str, float], ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise LoraSpecError(f"expected a list of {{\"name\": ..., \"scale\": ...}}, got {type(value).__name__}")
    if len(value) > MAX_PER_REQUEST:
        raise LoraSpecError(f"{len(value)} adapters; at most {MAX_PER_REQUEST} per request")
    out: list[tuple[str, float]] = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping) or set(item) - {"name", "scale"} or "name" not in item:
            raise LoraSpecError(f"item {i}: expected {{\"name\": ..., \"scale\": ...}} (scale optional), got {item!r}"[:200])
        name, scale = item["name"], item.get("scale", 1.0)
        if not isinstance(name, str) or name not in known:
            raise LoraSpecError(str(not_loaded(name, known, "none (LoRA adapters need the torch backend and "
                                                            "--lora-dir or POST /v1/loras)"))[:300])
        if (not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale)
                or abs(scale) > MAX_SCALE):
            raise LoraSpecError(f"adapter {name!r}: scale must be a number in [-{MAX_SCALE:g}, {MAX_SCALE:g}], "
                                f"got {scale!r}")
        if any(name == n for n, _ in out):
            raise LoraSpecError(f"adapter {name!r} is named twice; give it once with its scale")
        out.append((name, float(scale)))
    return tuple(out)


def requested_names(value: object) -> list[str]:
    """The adapter names a `loras` value gives, before any check (what parse_loras refuses is left out or refused
    later): what the front end looks up once for adapters registered elsewhere."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_PER_REQUEST:
        return []
    return [item["name"] for item in value if isinstance(item, Mapping) and isinstance(item.get("name"), str)]
