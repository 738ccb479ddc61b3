"""A request's `controls` (ControlNets, stepserve/controls) checked against the model: what its family declares
(stepserve/capabilities.py) says whether it runs ControlNets, with an image (image to image, inpainting) where its
diffusers ControlNet img2img / inpaint pipelines were matched, and with step caching (only on a UNet: caching/unet.py
gives a skipped row this step's residuals for its skips; on the transformers caching follows diffusers' block
hooks, which add each block's residual again on a skipped step on top of the cached ones, no reference worth
matching, so it stays refused there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..caching.spec import parse_cache
from ..controls.spec import Control, ControlSpecError, parse_controls
from ..capabilities import capabilities, served_for, where_served
from .types import ModelInfo, SamplingParams


def resolve_controls(p: SamplingParams, model: ModelInfo, image, to_image: Callable[[str, Any], Any]
                     ) -> tuple[Control, ...]:
    """The request's ControlNets, or () for none. `image`: the request's start image (None for text to image);
    `to_image(field, picture)`: the picture as an RGB image (raising the caller's error). A ControlSpecError names
    the field and what is allowed (validation.py makes it a ValidationError)."""
    if p.controls in (None, [], ()):
        return ()
    if not model.controls:
        raise ControlSpecError("controls", f"{model.name} ({model.family} family) takes no ControlNets here; "
                                           f"allowed: none (ControlNets are served for {where_served('controlnets')})")
    family = capabilities(model.family)
    if image is not None and p.mask_image is not None and not family.controls_with_mask:
        raise ControlSpecError("controls", f"{model.name} ({model.family} family) takes no controls with "
                                           f"inpainting (mask_image){_because(family.no_controls_with_mask)}; allowed: controls "
                                           f"with {_with_what(family)} (with inpainting they are served for "
                                           f"{served_for('controls_with_mask')})")
    if image is not None and not family.controls_with_image:
        raise ControlSpecError("controls", f"{model.name} ({model.family} family) takes no controls with an image "
                                           f"(image to image); allowed: controls with text to image (with an image "
                                           f"they are served for {served_for('controls_with_image')})")
    if not family.caches_with_controls and p.cache is not None and parse_cache(p.cache, model) is not None:
        raise ControlSpecError("cache", f"step caching does not combine with controls on {model.name} "
                                        f"({model.family} family); allowed: \"off\" or unset (controls cache "
                                        f"on {served_for('caches_with_controls')})")
    return parse_controls(p.controls, model.control_names, to_image, model.family, model.control_guess_only)



def _because(why: str) -> str:
    return f": {why}" if why else ""


def _with_what(family) -> str:
    return "text to image or image to image" if family.controls_with_image else "text to image"
