"""A request's `controls` (ControlNets, stepserve/controls) checked against the model: the family must run
ControlNets, with an image only where its diffusers ControlNet img2img / inpaint pipelines were matched, and with
step caching only on a UNet (CACHES_WITH_CONTROLS)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..caching.spec import parse_cache
from ..controls.errors import SERVED_FOR
from ..controls.spec import Control, ControlSpecError, parse_controls
from .types import ModelInfo, SamplingParams

CONTROLS_WITH_AN_IMAGE = ("sd", "sdxl", "flux")  # the families whose ControlNet img2img/inpaint pipelines match
# The families whose step caching takes ControlNet residuals (caching/unet.py: a skipped row runs the shallow branch
# with this step's residuals for its skips, on the deep features of its last full step, which had that step's). On
# the transformers caching follows diffusers' block hooks, which add each block's residual again on a skipped step
# on top of the cached ones: no reference worth matching, so it stays refused there.
CACHES_WITH_CONTROLS = ("sd", "sdxl")


def resolve_controls(p: SamplingParams, model: ModelInfo, image, to_image: Callable[[str, Any], Any]
                     ) -> tuple[Control, ...]:
    """The request's ControlNets, or () for none. `image`: the request's start image (None for text to image);
    `to_image(field, picture)`: the picture as an RGB image (raising the caller's error). A ControlSpecError names
    the field and what is allowed (validation.py makes it a ValidationError)."""
    if p.controls in (None, [], ()):
        return ()
    if not model.controls:
        raise ControlSpecError("controls", f"{model.name} ({model.family} family) takes no ControlNets here; "
                                           f"allowed: none (ControlNets are served for {SERVED_FOR})")
    if image is not None and model.family not in CONTROLS_WITH_AN_IMAGE:
        raise ControlSpecError("controls", f"{model.name} ({model.family} family) takes no controls with an image "
                                           f"here; allowed: controls with text to image (with an image they are "
                                           f"served for SD 1/2 and SDXL, and Flux.1 image to image)")
    if image is not None and p.mask_image is not None and model.family == "flux":
        raise ControlSpecError("controls", f"{model.name} inpaints with Flux Fill, whose transformer takes the mask "
                                           "as input channels: no Flux.1 ControlNet fits it; allowed: controls with "
                                           "text to image or image to image")
    if model.family not in CACHES_WITH_CONTROLS and p.cache is not None and parse_cache(p.cache, model) is not None:
        raise ControlSpecError("cache", f"step caching does not combine with controls on {model.name} "
                                        f"({model.family} family); allowed: \"off\" or unset (controls cache "
                                        f"on SD 1/2 and SDXL)")
    return parse_controls(p.controls, model.control_names, to_image, model.family, model.control_guess_only)
