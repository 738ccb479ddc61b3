"""A request's `ip_adapter` (an image as a prompt, stepserve/ipadapter) checked against the model: the family must
run IP-Adapters (text to image, image to image or inpainting; with step caching too: the UNet's cached forward keeps
each row's adapter scales on the rows that run the deep part)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..ipadapter.spec import IPAdapterSpecError, ImagePrompt, parse_ip_adapter
from ..capabilities import where_served
from .types import ModelInfo, SamplingParams


def resolve_ip_adapter(p: SamplingParams, model: ModelInfo, to_image: Callable[[str, Any], Any]
                       ) -> tuple[ImagePrompt, ...] | None:
    """The request's image prompts (one per adapter it names), or None. `to_image(field, picture)`: the picture as an RGB image (raising the
    caller's error). An IPAdapterSpecError names the field and what is allowed (validation.py makes it a
    ValidationError)."""
    if p.ip_adapter is None:
        return None
    if not model.ip_adapters:
        raise IPAdapterSpecError("ip_adapter", f"{model.name} ({model.family} family) takes no IP-Adapter here; "
                                               f"allowed: none (IP-Adapters are served for "
                                               f"{where_served('ip_adapter')})")
    return parse_ip_adapter(p.ip_adapter, model.ip_adapter_names, to_image)
