"""A request's `cache` field -> a CacheSpec (or None: no caching). Pure data: no torch.

Accepted forms: None (the model's default_cache, i.e. the server's --cache), "off" / "none" / False (no caching),
a policy name ("fbcache", "deepcache", "magcache": that policy with its default knobs), or a mapping
{"policy": name, <knob>: value, ...}. What each policy does: stepserve/caching and docs/CACHING.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..capabilities import served_for

ModelInfo = Any  # stepserve.request.types.ModelInfo (that module imports this one)


@dataclass(frozen=True)
class CacheSpec:
    """A request's step-caching policy (stepserve/caching, docs/CACHING.md): which rule decides, per request and
    per step, to reuse cached work instead of running the whole denoiser. Built by parse_cache."""

    policy: str  # "fbcache" (first-block cache), "deepcache" (UNets) or "magcache" (Flux)
    threshold: float | None = None  # fbcache: relative change that forces a full step; magcache: error budget
    interval: int | None = None  # deepcache: a full forward every `interval` steps
    max_skip_steps: int | None = None  # magcache: at most this many skipped steps in a row
    retention_ratio: float | None = None  # magcache: the first fraction of the steps always runs in full


# policy -> its knobs with their defaults (diffusers 0.42's FirstBlockCacheConfig and MagCacheConfig defaults for
# the two it defines; DeepCache's uniform interval 3 from Ma et al., CVPR 2024)
POLICIES: dict[str, dict[str, float | int]] = {
    "fbcache": {"threshold": 0.05},
    "deepcache": {"interval": 3},
    "magcache": {"threshold": 0.06, "max_skip_steps": 3, "retention_ratio": 0.2},
}
OFF = ("off", "none")
MAX_INTERVAL = 50
MAX_THRESHOLD = 10.0


class CacheSpecError(ValueError):
    """What is wrong with a `cache` value; validation.py reports it as a ValidationError on field "cache"."""


def _allowed(model: ModelInfo) -> str:
    names = ", ".join(model.cache_policies) if model.cache_policies else "none on this model"
    return f"'off', a policy name ({names}), or {{\"policy\": name, knobs...}}"


def parse_cache(value: object, model: ModelInfo) -> CacheSpec | None:
    """The CacheSpec `value` asks for on `model`, or None (no caching). Raises CacheSpecError naming what is
    allowed."""
    if value is None:
        return model.default_cache
    if value is False or (isinstance(value, str) and value.lower() in OFF):
        return None
    if isinstance(value, CacheSpec):
        knobs = {k: v for k, v in vars(value).items() if k != "policy" and v is not None}
        value = {"policy": value.policy, **knobs}
    if isinstance(value, str):
        value = {"policy": value}
    if not isinstance(value, Mapping):
        raise CacheSpecError(f"expected {_allowed(model)}, got {type(value).__name__}")
    if "policy" not in value:
        raise CacheSpecError(f"an object needs \"policy\" (one of {', '.join(POLICIES)}), got keys "
                             f"{', '.join(map(str, value)) or 'none'}")
    policy = value.get("policy")
    if policy not in POLICIES:
        raise CacheSpecError(f"policy {policy!r} is not a caching policy; allowed: {', '.join(POLICIES)}")
    if not model.cache_policies:
        raise CacheSpecError(f"{model.name} serves no step caching here: it runs on the torch backend, without "
                             f"--compile/--deterministic, for {served_for('caches')} models")
    if policy not in model.cache_policies:
        runs = ", ".join(model.cache_policies)
        raise CacheSpecError(f"policy {policy!r} does not run on {model.name} ({model.family} family); "
                             f"allowed here: {runs}")
    knobs = POLICIES[policy]
    unknown = sorted(set(value) - {"policy"} - set(knobs))
    if unknown:
        raise CacheSpecError(f"{policy} takes {', '.join(knobs)}; unknown: {', '.join(map(str, unknown))}")
    spec = CacheSpec(policy, **{k: _knob(policy, k, value.get(k, default)) for k, default in knobs.items()})
    return spec


def _knob(policy: str, name: str, value: object) -> float | int:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if name in ("interval", "max_skip_steps"):
        top = MAX_INTERVAL
        if not (number and value == int(value) and 1 <= value <= top):
            raise CacheSpecError(f"{policy} {name} must be an integer in [1, {top}], got {value!r}")
        return int(value)
    if name == "retention_ratio":
        if not (number and 0 <= value <= 1):
            raise CacheSpecError(f"{policy} {name} must be a number in [0, 1], got {value!r}")
        return float(value)
    if not (number and math.isfinite(value) and 0 <= value <= MAX_THRESHOLD):
        raise CacheSpecError(f"{policy} {name} must be a number in [0, {MAX_THRESHOLD:g}] (0: never skip), "
                             f"got {value!r}")
    return float(value)


def with_default(model: ModelInfo, policies: tuple[str, ...], default: object) -> ModelInfo:
    """`model` running `policies`, with `default` (any form parse_cache takes; None: off) for requests that do not
    say."""
    model = replace(model, cache_policies=tuple(policies), default_cache=None)
    return replace(model, default_cache=parse_cache(default if default is not None else "off", model))
