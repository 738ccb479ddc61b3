"""The errors of LoRA adapters: the add-ons' errors (stepserve/addons/errors.py), as ControlNets' and IP-Adapters'
are, so each front end maps them to its own status without reading messages.

Every message says what was wrong and what is allowed. `param` names the field of a POST /v1/loras body (or of a
request) that the error is about.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..addons.errors import AddonBudgetError, AddonError, AddonTooLargeError


class LoraError(AddonError):
    """An adapter that cannot be loaded, named or served; the message says which and why (HTTP 400)."""

    default_param = "name"


class LoraUnsupportedError(LoraError):
    """This model or backend serves no LoRA adapters, or the server has no adapter folder (HTTP 400)."""


class LoraNotFoundError(LoraError):
    """No adapter of that name is loaded or in the folder (HTTP 404 where the name is in the path)."""


class LoraTooLargeError(LoraError, AddonTooLargeError):
    """The adapter is larger than the whole adapter memory: it can never be loaded, whatever is evicted (413)."""


class LoraBudgetError(LoraError, AddonBudgetError):
    """The adapter memory (or count) is held by adapters that requests carry: retry later (HTTP 429)."""


class LoraInUseError(LoraError):
    """The adapter is carried by requests (a delete that waited in vain), or its name is taken (HTTP 409)."""


def not_loaded(name: str, loaded: Iterable[str], none: str = "none") -> LoraNotFoundError:
    """The one "not loaded" error: the name, and the names that are (`none`: what to say where none is)."""
    return LoraNotFoundError(f"adapter {name!r} is not loaded; loaded: {', '.join(sorted(loaded)) or none}")


# torch's load_state_dict says this once per layer (a wrong-size adapter: kilobytes of lines)
_MISMATCH = re.compile(r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) from "
                       r"checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)")


def does_not_fit(name: str, shown: str, module: str, detail: str) -> LoraError:
    """The one line for an adapter the model's layers cannot take: which adapter, which model part, the first
    layer that differs (the model's own name for it) and its shapes, and how many more differ; another failure
    keeps its first line only. `detail`: the library's message, paths already scrubbed."""
    found = _MISMATCH.findall(detail)
    if not found:
        first = (detail.strip().splitlines() or ["unknown error"])[0][:200]
        return LoraError(f"adapter {name!r}: {shown} does not fit this model's {module}: {first}", "path")
    layer, got, want = found[0]
    more = f" (and {len(found) - 1} more layers differ)" if len(found) > 1 else ""
    return LoraError(f"adapter {name!r}: {shown} does not fit this model's {module}: its weights for "
                     f"{layer.split('.lora_')[0]} are [{got}], the layer takes [{want}]{more}; allowed: adapters "
                     f"made for this model (its family and size)", "path")
