"""The errors of ControlNets: typed as the LoRA adapters' are (stepserve/lora/errors.py), so each front end maps
them to its own status without reading messages. `param` names the field the error is about."""

from __future__ import annotations

from collections.abc import Iterable

from ..capabilities import where_served


class ControlNetError(ValueError):
    """A ControlNet that cannot be named, loaded or served; the message says which and why (HTTP 400)."""

    def __init__(self, message: str, param: str = "controls") -> None:
        super().__init__(message)
        self.param = param


class ControlNetTooLargeError(ControlNetError):
    """Larger than the whole ControlNet memory (--controlnet-memory-mb): it can never be loaded."""


class ControlNetBudgetError(ControlNetError):
    """The ControlNet memory is held by ControlNets the step in flight uses: retry later."""


def unknown_name(name: object, served: Iterable[str]) -> str:
    """The one "not served" message: the name and the names that are."""
    names = ", ".join(sorted(served)) or (f"none (ControlNets need --controlnet-dir, and are served for "
                                          f"{where_served('controlnets')})")
    return f"ControlNet {str(name)[:80]!r} is not served; served: {names}"
