"""The errors of ControlNets: the add-ons' errors (stepserve/addons/errors.py), as LoRA adapters' and IP-Adapters'
are, so each front end maps them to its own status without reading messages. `param` names the field the error is
about."""

from __future__ import annotations

from collections.abc import Iterable

from ..addons.errors import AddonBudgetError, AddonError, AddonTooLargeError
from ..capabilities import where_served


class ControlNetError(AddonError):
    """A ControlNet that cannot be named, loaded or served; the message says which and why (HTTP 400)."""

    default_param = "controls"


class ControlNetTooLargeError(ControlNetError, AddonTooLargeError):
    """Larger than the whole ControlNet memory (--controlnet-memory-mb), alone or with the others of its request:
    it can never be loaded (HTTP 400)."""


class ControlNetBudgetError(ControlNetError, AddonBudgetError):
    """The ControlNet memory is held by ControlNets that requests in flight use: retry later (HTTP 429)."""


def unknown_name(name: object, served: Iterable[str]) -> str:
    """The one "not served" message: the name and the names that are."""
    names = ", ".join(sorted(served)) or (f"none (ControlNets need --controlnet-dir, and are served for "
                                          f"{where_served('controlnets')})")
    return f"ControlNet {str(name)[:80]!r} is not served; served: {names}"
