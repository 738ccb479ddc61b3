"""A request's `controls` field -> a tuple of Control, checked against the ControlNets served
(ModelInfo.control_names). Pure data: no torch.

Accepted: None or [] (no control), or a list of {"name": str, "image": picture, "scale": number, "start": number,
"end": number} (scale defaults to 1.0, start to 0 and end to 1, as diffusers' controlnet_conditioning_scale and
control_guidance_start/end), at most MAX_PER_REQUEST, each name once. `"preprocess": "canny"` makes the control map
from the image (a photo) on the server (preprocess.py). Several controls add up, each weighted by its
scale, as diffusers' MultiControlNetModel sums them.

Guess mode (`"guess_mode": true`, SD 1/2 and SDXL: diffusers' `guess_mode`) is one setting per request, as it is one
flag per diffusers call: a request is in guess mode when a control asks for it or names a ControlNet that runs in
guess mode only (`global_pool_conditions` in its config: `guess_only`), and then every control of it is. A request
whose controls say true and false, or false beside a guess-only ControlNet, is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..capabilities import capabilities, served_for
from ..util.field_error import FieldError
from .errors import unknown_name
from .preprocess import PREPROCESSORS, PreprocessUnavailable, apply, available

MAX_PER_REQUEST = 4
MAX_SCALE = 10.0
KEYS = ("name", "image", "scale", "start", "end", "preprocess", "guess_mode")


class ControlSpecError(FieldError):
    """What is wrong with a `controls` value; `field` names it (e.g. "controls[1].scale")."""


@dataclass(frozen=True)
class Control:
    """One control of a request: a ControlNet by name, its image (resolved: an RGB PIL image), its scale and the
    fraction of the schedule [start, end] where it applies; `guess_mode`: its request's (resolved)."""

    name: str
    image: Any
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    guess_mode: bool = False

    def weight(self, step: int, num_steps: int) -> float:
        """Its scale at `step` of `num_steps`, 0 outside its window (diffusers' controlnet_keep)."""
        outside = step / num_steps < self.start or (step + 1) / num_steps > self.end
        return 0.0 if outside else self.scale


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_controls(value: object, known: frozenset[str], to_image: Callable[[str, Any], Any],
                   family: str = "sd", guess_only: frozenset[str] = frozenset()) -> tuple[Control, ...]:
    """`to_image(field, picture)`: the picture as an RGB PIL image (raising the caller's error for a bad one);
    `family`: the model's; `guess_only`: the served ControlNets that run in guess mode only. A Control (resolved
    already) is checked again as the fields it stands for."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ControlSpecError("controls", f"expected a list of {{\"name\", \"image\", \"scale\", \"start\", "
                                           f"\"end\"}}, got {type(value).__name__}")
    if len(value) > MAX_PER_REQUEST:
        raise ControlSpecError("controls", f"{len(value)} controls; at most {MAX_PER_REQUEST} per request")
    value = [_as_sent(c) if isinstance(c, Control) else c for c in value]
    out: list[Control] = []
    for i, item in enumerate(value):
        at = f"controls[{i}]"
        if not isinstance(item, Mapping) or "name" not in item or "image" not in item:
            raise ControlSpecError(at, f"expected {{\"name\": ..., \"image\": ...}} (scale, start, end optional), "
                                       f"got {str(item)[:120]}")
        extra = sorted(set(map(str, item)) - set(KEYS))
        if extra:
            raise ControlSpecError(at, f"unknown key(s) {', '.join(extra)}; allowed: {', '.join(KEYS)}")
        name = item["name"]
        if not isinstance(name, str) or name not in known:
            raise ControlSpecError(f"{at}.name", unknown_name(name, known))
        if any(c.name == name for c in out):
            raise ControlSpecError(f"{at}.name", f"ControlNet {name!r} is named twice; give it once")
        scale, start, end = item.get("scale", 1.0), item.get("start", 0.0), item.get("end", 1.0)
        if not _number(scale) or not 0 <= scale <= MAX_SCALE:
            raise ControlSpecError(f"{at}.scale", f"must be a number in [0, {MAX_SCALE:g}], got {scale!r}")
        for key, v in (("start", start), ("end", end)):
            if not _number(v) or not 0 <= v <= 1:
                raise ControlSpecError(f"{at}.{key}", f"must be a number in [0, 1] (a fraction of the schedule), "
                                                      f"got {v!r}")
        if not start < end:
            raise ControlSpecError(f"{at}.start", f"must be below end (the window of the schedule where the "
                                                  f"control applies), got start {start!r} and end {end!r}")
        preprocess = item.get("preprocess")
        if preprocess is not None:
            if preprocess not in PREPROCESSORS:
                raise ControlSpecError(f"{at}.preprocess", f"unknown preprocessor {preprocess!r}; allowed: "
                                                           f"{', '.join(PREPROCESSORS)} (send other maps as the image)")
            try:
                available(preprocess)
            except PreprocessUnavailable as exc:
                raise ControlSpecError(f"{at}.preprocess", str(exc)) from None
        image = to_image(f"{at}.image", item["image"])
        image = apply(preprocess, image) if preprocess else image
        out.append(Control(name, image, float(scale), float(start), float(end)))
    guess = _guess_mode(value, out, family, guess_only)
    return tuple(replace(c, guess_mode=guess) for c in out)


def _as_sent(c: Control) -> dict:
    """A control resolved already (at the edge: the server resolves a request's once, off its event loop, and every
    image of `n` shares it) as the fields that resolve to it again: its image is decoded and preprocessed."""
    return {"name": c.name, "image": c.image, "scale": c.scale, "start": c.start, "end": c.end,
            **({"guess_mode": True} if c.guess_mode else {})}


def _guess_mode(items: list | tuple, controls: list[Control], family: str, guess_only: frozenset[str]) -> bool:
    """The request's guess mode: one for all its controls (see the module docstring)."""
    said: dict[int, bool] = {}
    for i, item in enumerate(items):
        if "guess_mode" not in item:
            continue
        if not capabilities(family).guess_mode:
            raise ControlSpecError(f"controls[{i}].guess_mode", f"{family} ControlNets have no guess mode (it is "
                                                                f"served for {served_for('guess_mode')}); allowed: "
                                                                f"no guess_mode")
        if not isinstance(item["guess_mode"], bool):
            raise ControlSpecError(f"controls[{i}].guess_mode", f"must be true or false, got {item['guess_mode']!r}")
        said[i] = item["guess_mode"]
    forced = [i for i, c in enumerate(controls) if c.name in guess_only]
    guess = any(said.values()) or bool(forced)
    for i, value in said.items():
        if value != guess:
            why = (f"controls[{forced[0]}] ({controls[forced[0]].name!r}) runs in guess mode only (its ControlNet "
                   f"pools its conditions: global_pool_conditions)" if forced
                   else f"controls[{min(j for j, v in said.items() if v)}] says true")
            raise ControlSpecError(f"controls[{i}].guess_mode", f"guess mode is one setting per request and "
                                                                f"{why}; allowed: true or unset on every control")
    return guess


def different_depths(names, shapes: Mapping, within: str = "one request") -> str:
    """The one message for ControlNets of different depths (`shapes`: name -> (what, count) pairs, e.g.
    ("num_layers", 2)): one request's are summed block by block, as diffusers' Multi models sum them."""
    shown = "; ".join(f"{n}: {', '.join(f'{k} {v}' for k, v in s)}" for n, s in sorted(shapes.items()))
    return (f"the ControlNets {', '.join(sorted(names))} give different numbers of block outputs ({shown}), so they "
            f"cannot be combined in {within}; allowed: ControlNets of the same depth in {within}")
