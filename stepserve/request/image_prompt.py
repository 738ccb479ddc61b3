"""A request's `ip_adapter` (an image as a prompt, stepserve/ipadapter) checked against the model: the family must
run IP-Adapters, the request is text to image and takes every step whole."""

from __future__ import annotations

from ..caching.spec import parse_cache
from ..ipadapter.spec import IPAdapterSpecError, ImagePrompt, parse_ip_adapter
from .types import ModelInfo, SamplingParams


def resolve_ip_adapter(p: SamplingParams, model: ModelInfo, image) -> ImagePrompt | None:
    """The request's image prompt, or None; a ValidationError names the field and what is allowed."""
    from .validation import ValidationError, as_image  # validation imports this module

    if p.ip_adapter is None:
        return None
    if not model.ip_adapters:
        raise ValidationError("ip_adapter", f"{model.name} ({model.family} family) takes no IP-Adapter here; "
                                            f"allowed: none (IP-Adapters are served for SD 1/2 models on the torch "
                                            f"backend, without --compile/--deterministic)")
    if image is not None:
        raise ValidationError("ip_adapter", "goes with text to image here; allowed: no image with ip_adapter")
    if p.cache is not None and parse_cache(p.cache, model) is not None:
        raise ValidationError("cache", "step caching does not combine with ip_adapter; allowed: \"off\" or unset")
    try:
        return parse_ip_adapter(p.ip_adapter, model.ip_adapter_names, lambda field, v: as_image(field, v, "RGB"))
    except IPAdapterSpecError as exc:
        raise ValidationError(exc.field, str(exc)) from None
