"""The ControlNets an executor serves: every sub-folder of the ControlNet folder that holds a diffusers ControlNet
(config.json of a ControlNetModel and its weights) is servable by the sub-folder's name.

A ControlNet is loaded when a request first needs it (the front end before queueing it, else the request's
admission: `ensure`), within `budget_bytes` of memory: the add-ons' one budgeted store (stepserve/addons/store.py)
decides, as it does for LoRA adapters and IP-Adapters. Its size is read from its weights file's header before
anything is read (at the width of the dtype in force); one larger than the whole memory is refused without a load,
and remembered; the ControlNets of admitted, unfinished requests are never unloaded (each request holds its own
from its admission), so a request that does not fit beside them is refused with a retry-later error rather than
unloading theirs; to make room, the least recently used idle ones are unloaded (they load again on their next use).
A folder whose config is not a ControlNet for this model (another family's, a different UNet) is refused when a
request first needs it, before anything is unloaded for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..addons import sizes
from ..addons.store import AddonBudget, Kind
from ..lora.folder import Watched
from .errors import ControlNetBudgetError, ControlNetError, ControlNetTooLargeError, unknown_name

# what ControlNetModel.from_pretrained reads, in the order it prefers them (names as diffusers spells them)
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
KIND = Kind("ControlNet", "ControlNets", "ControlNet memory", "--controlnet-memory-mb", ControlNetTooLargeError,
            ControlNetBudgetError, "controls")


@dataclass(frozen=True)
class Loaded:
    module: object  # diffusers ControlNetModel, on the pipeline's device and dtype
    bytes: int


def weights_of(folder: Path) -> Path | None:
    return next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)


def discover(root: Path | None) -> dict[str, Path]:
    """The folder's ControlNets by name: its sub-folders with a config.json and a weights file."""
    if root is None or not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir())
            if d.is_dir() and (d / "config.json").is_file() and weights_of(d) is not None}


def _pools(folder: Path) -> bool:
    try:
        return bool(json.loads((folder / "config.json").read_text()).get("global_pool_conditions"))
    except (OSError, ValueError, AttributeError):  # not a readable config: refused, saying why, when first named
        return False


class ControlNetStore:
    """ControlNets by name for one pipeline (a family adapter with pipelines/control_inputs.py's methods)."""

    def __init__(self, pipeline, root: str | Path | None, budget_bytes: int | None = None) -> None:
        self.pipeline = pipeline
        self.root = Path(root).resolve() if root is not None else None
        self.loaded: dict[str, Loaded] = {}
        self.budget = AddonBudget(KIND, lambda name: self.loaded.pop(name, None), budget_bytes)
        self._folder = Watched(self.root, discover)
        self._guess: tuple = (None, frozenset())  # (the folder's entries, the names of those that pool)

    budget_bytes = property(lambda self: self.budget.budget_bytes,
                            lambda self, value: setattr(self.budget, "budget_bytes", value))
    loads = property(lambda self: self.budget.loads)
    evictions = property(lambda self: self.budget.evictions)

    def files(self) -> dict[str, Path]:
        """The folder's ControlNets by name, looked for again only when the folder changed."""
        return self._folder.files()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.files()) | frozenset(self.loaded)

    @property
    def guess_only(self) -> frozenset[str]:
        """The ControlNets that run in guess mode only: `global_pool_conditions` in their config (diffusers' pipeline
        forces guess mode for them). Their configs are read again only when the folder changed."""
        files = self.files()
        if self._guess[0] is not files:
            self._guess = (files, frozenset(n for n, d in files.items() if _pools(d)))
        loaded = list(self.loaded.items())  # one copy: a load on another thread may add to it meanwhile
        return self._guess[1] | frozenset(n for n, c in loaded if getattr(c.module.config, "global_pool_conditions",
                                                                          False))

    @property
    def loaded_bytes(self) -> int:
        return self.budget.loaded_bytes

    def listing(self) -> list[dict]:
        """GET /v1/controlnets: every servable ControlNet, loaded or not."""
        loaded = dict(self.loaded)
        return [{"name": n, "loaded": n in loaded, "bytes": loaded[n].bytes if n in loaded else None}
                for n in sorted(self.names)]

    def ensure(self, names, holder=None) -> dict:
        """The modules of `names` by name, loading those that are not loaded (they count as just used) and
        unloading least recently used idle others for room. `holder`: the request that uses them, which holds them
        until it finishes (none of them is unloaded meanwhile). Safe beside a load on another thread (the front end
        loads before queueing): what it returns stays usable even if unloaded meanwhile. Raises ControlNetError
        (not servable, not for this model), ControlNetTooLargeError (it, or the request's together, can never
        fit), ControlNetBudgetError (not beside those requests in flight hold: retry later)."""
        names = list(dict.fromkeys(names))
        if holder is not None:  # first: nothing it names is unloaded from here on
            self.budget.hold(holder, names)
        try:  # all loaded (every step after the first): no lock, so a load elsewhere never stalls a step
            modules = {name: self.loaded[name].module for name in names}
        except KeyError:
            with self.budget.mutex:
                for name in (n for n in names if n not in self.loaded):
                    self._load(name, names)
                modules = {name: self.loaded[name].module for name in names}
        self.budget.touch(names)
        return modules

    def _load(self, name: str, own: list[str]) -> None:
        folder = self.files().get(name)
        if folder is None:
            raise ControlNetError(unknown_name(name, self.names))
        weights = weights_of(folder)
        stamp = sizes.stamp([weights])
        self.budget.remembered(name, stamp)  # found too large before: refused without reading anything
        self._check_config(name, json.loads((folder / "config.json").read_text()))
        width = torch.empty((), dtype=self.pipeline.dtype).element_size()
        try:
            size = sizes.file_bytes(weights, width)
        except (OSError, ValueError) as exc:
            raise ControlNetError(f"ControlNet {name!r}: its weights file cannot be read ({exc}); allowed: "
                                  f"diffusers ControlNet folders") from None
        self.budget.reserve(name, size, own, stamp=stamp)  # before the load: nothing read for one that cannot fit
        try:
            module = self.pipeline.controlnet_class().from_pretrained(folder, torch_dtype=self.pipeline.dtype)
        except Exception as exc:  # noqa: BLE001 - diffusers raises many kinds for a folder it cannot read
            self.budget.cancel(name)
            raise ControlNetError(f"ControlNet {name!r}: its folder does not load as a diffusers ControlNet: "
                                  f"{str(exc)[:200]}") from None
        real = sum(p.numel() * p.element_size() for p in module.parameters())
        self.budget.settle(name, real, own, stamp=stamp)
        self.loaded[name] = Loaded(module.to(self.pipeline.device).eval(), real)

    def _check_config(self, name: str, config: dict) -> None:
        """The folder is a ControlNet of this model's denoiser (the family says what must match:
        pipelines/control_inputs.py)."""
        problems = [p for p in self.pipeline.control_problems(config) if p]
        if problems:
            raise ControlNetError(f"ControlNet {name!r} does not fit {self.pipeline.info.name} "
                                  f"({self.pipeline.family}): {'; '.join(problems)}; allowed: ControlNets made for "
                                  f"this model")
