"""A request's `ip_adapter` field -> an ImagePrompt, checked against the IP-Adapters served
(ModelInfo.ip_adapter_names). Pure data: no torch.

Accepted: None (no image prompt), {"name": str, "image": picture, "scale": number} (scale defaults to 1.0, as
diffusers' set_ip_adapter_scale; at most MAX_SCALE), or a list of up to MAX_PROMPTS of those, each naming another
adapter (diffusers' list of adapters, images and scales for one call). Resolved: a tuple of ImagePrompt in the
request's order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..util.field_error import FieldError

MAX_SCALE = 10.0
MAX_PROMPTS = 4
KEYS = ("name", "image", "scale")
FIELD = "ip_adapter"


class IPAdapterSpecError(FieldError):
    """What is wrong with an `ip_adapter` value; `field` names it (e.g. "ip_adapter.scale")."""


@dataclass(frozen=True)
class ImagePrompt:
    """A request's image prompt: an IP-Adapter by name, its image (resolved: an RGB PIL image) and its scale."""

    name: str
    image: Any
    scale: float = 1.0


def unknown_name(name: object, served) -> str:
    """The one "not served" message: the name and the names that are."""
    names = ", ".join(sorted(served)) or "none (IP-Adapters need an SD 1/2 or SDXL model on the torch backend and " \
                                        "--ip-adapter-dir)"
    return f"IP-Adapter {str(name)[:80]!r} is not served; served: {names}"


def parse_ip_adapter(value: object, known: frozenset[str], to_image: Callable[[str, Any], Any]
                     ) -> tuple[ImagePrompt, ...] | None:
    """`to_image(field, picture)`: the picture as an RGB PIL image (raising the caller's error for a bad one)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not 1 <= len(value) <= MAX_PROMPTS:
            raise IPAdapterSpecError(FIELD, f"expected 1 to {MAX_PROMPTS} image prompts, got {len(value)}")
        out = tuple(_one(item, f"{FIELD}[{i}]", known, to_image) for i, item in enumerate(value))
        names = [p.name for p in out]
        twice = next((i for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise IPAdapterSpecError(f"{FIELD}[{twice}].name", f"IP-Adapter {names[twice]!r} is named twice; "
                                                                f"allowed: each adapter once per request")
        return out
    return (_one(value, FIELD, known, to_image),)


def _one(value: object, field: str, known: frozenset[str], to_image: Callable[[str, Any], Any]) -> ImagePrompt:
    if isinstance(value, ImagePrompt):
        value = {"name": value.name, "image": value.image, "scale": value.scale}
    if not isinstance(value, Mapping) or "name" not in value or "image" not in value:
        raise IPAdapterSpecError(field, f"expected {{\"name\": ..., \"image\": ...}} (scale optional), or a list "
                                        f"of those, got {str(value)[:120]}")
    extra = sorted(set(map(str, value)) - set(KEYS))
    if extra:
        raise IPAdapterSpecError(field, f"unknown key(s) {', '.join(extra)}; allowed: {', '.join(KEYS)}")
    name = value["name"]
    if not isinstance(name, str) or name not in known:
        raise IPAdapterSpecError(f"{field}.name", unknown_name(name, known))
    scale = value.get("scale", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) \
            or not 0 <= scale <= MAX_SCALE:
        raise IPAdapterSpecError(f"{field}.scale", f"must be a number in [0, {MAX_SCALE:g}] (the weight of the "
                                                   f"image prompt, diffusers' IP-Adapter scale), got {scale!r}")
    return ImagePrompt(name, to_image(f"{field}.image", value["image"]), float(scale))
