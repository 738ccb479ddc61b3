"""The errors every kind of add-on raises (LoRA adapters, ControlNets, IP-Adapters): typed, so each front end maps
them to its own status without reading messages. Each kind's own errors subclass these (lora/errors.py,
controls/errors.py, ipadapter/parts.py): a front end that knows only these three serves every kind the same way.

- AddonError: the request's own bad input, permanent (HTTP 400 naming `param`);
- AddonTooLargeError: larger than the whole memory of its kind, alone or beside the others the same request
  names: it can never be served, whatever is unloaded (400: not one to retry);
- AddonBudgetError: it does not fit now beside the add-ons that requests in flight hold (429 with Retry-After).
"""

from __future__ import annotations

RETRY_AFTER_S = 1  # what a held budget tells the client to wait: requests in flight end within steps


class AddonError(ValueError):
    """An add-on that cannot be named, loaded or served; the message says which and why. `param`: the field it
    is about (each kind's default: `default_param`)."""

    default_param = "name"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param or self.default_param

    def __reduce__(self):  # the field survives pickling (results cross processes to a fleet's front)
        return type(self), (str(self), self.param)


class AddonTooLargeError(AddonError):
    """Larger than the whole memory of its kind (alone or with the others of its request): never servable."""


class AddonBudgetError(AddonError):
    """The memory of its kind is held by add-ons that requests in flight use: retry later."""

    retry_after_s = RETRY_AFTER_S
