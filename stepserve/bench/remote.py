"""Which target a `--target` string names: stepserve's HTTP API ('URL', 'label=URL') or a Triton model over
KServe v2 ('triton=URL', 'triton:label=URL'). Kept apart from both target modules, which it imports."""

from __future__ import annotations

from collections.abc import Callable

from .targets import HttpTarget, Target
from .triton_target import TritonTarget, is_triton_target, parse_triton_target


def server_target(text: str, api_key: str | None = None,
                  keep_images: bool = False) -> tuple[str, Callable[[], Target]]:
    """(label, factory) for a --target. A malformed Triton URL raises ValueError."""
    if is_triton_target(text):
        address = parse_triton_target(text)
        return address.label, lambda: TritonTarget(address, keep_images)
    name, url = text.split("=", 1) if "=" in text and not text.split("=", 1)[0].startswith("http") else (text, text)
    return name, lambda: HttpTarget(url, name, api_key)
