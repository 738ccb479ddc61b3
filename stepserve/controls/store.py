"""The ControlNets an executor serves: every sub-folder of the ControlNet folder that holds a diffusers ControlNet
(config.json of a ControlNetModel and its weights) is servable by the sub-folder's name.

A ControlNet is loaded when a step first needs it (the request's first step: `ensure`), within `budget_bytes` of
memory, the same policy as the LoRA adapters' (stepserve/lora/store.py): to make room, the least recently used
ControlNets that the step does not use are unloaded (they load again on their next use). A folder whose config is
not a ControlNet for this model (another family's, a different UNet) is refused when a request first needs it,
before anything is unloaded for it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from ..lora.folder import Watched
from .errors import ControlNetBudgetError, ControlNetError, ControlNetTooLargeError, unknown_name

WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")


@dataclass(frozen=True)
class Loaded:
    module: object  # diffusers ControlNetModel, on the pipeline's device and dtype
    bytes: int


def discover(root: Path | None) -> dict[str, Path]:
    """The folder's ControlNets by name: its sub-folders with a config.json and a weights file."""
    if root is None or not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir())
            if d.is_dir() and (d / "config.json").is_file() and any((d / f).is_file() for f in WEIGHT_FILES)}


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
        self.budget_bytes = budget_bytes
        self.loaded: dict[str, Loaded] = {}
        self.last_used: dict[str, int] = {}
        self._uses = 0
        self.evictions = 0
        self.version = 0  # bumped when the folder's names may have changed (the executor's ModelInfo lists them)
        self._mutex = threading.RLock()
        self._folder = Watched(self.root, discover)
        self._guess: tuple = (None, frozenset())  # (the folder's entries, the names of those that pool)

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
        return sum(c.bytes for c in self.loaded.values())

    def listing(self) -> list[dict]:
        """GET /v1/controlnets: every servable ControlNet, loaded or not."""
        loaded = dict(self.loaded)
        return [{"name": n, "loaded": n in loaded, "bytes": loaded[n].bytes if n in loaded else None}
                for n in sorted(self.names)]

    def ensure(self, names) -> dict:
        """The modules of `names` by name, loading those that are not loaded (they count as just used) and
        unloading least recently used others for room. Safe beside a load on another thread (the front end loads
        before queueing): what it returns stays usable even if unloaded meanwhile. Raises ControlNetError (not
        servable, not for this model), ControlNetTooLargeError, ControlNetBudgetError (it does not fit beside the
        others of `names`)."""
        names = list(dict.fromkeys(names))
        self._uses += 1
        try:  # all loaded (every step after the first): no lock, so a load elsewhere never stalls a step
            modules = {name: self.loaded[name].module for name in names}
        except KeyError:
            with self._mutex:
                for name in (n for n in names if n not in self.loaded):
                    self._load(name, keep=set(names))
                modules = {name: self.loaded[name].module for name in names}
        for name in names:
            self.last_used[name] = self._uses
        return modules

    def _load(self, name: str, keep: set[str]) -> None:
        if name in self.loaded:  # loaded by another thread meanwhile
            return
        folder = self.files().get(name)
        if folder is None:
            raise ControlNetError(unknown_name(name, self.names))
        self._check_config(name, json.loads((folder / "config.json").read_text()))
        try:
            module = self.pipeline.controlnet_class().from_pretrained(folder, torch_dtype=self.pipeline.dtype)
        except Exception as exc:  # noqa: BLE001 - diffusers raises many kinds for a folder it cannot read
            raise ControlNetError(f"ControlNet {name!r}: its folder does not load as a diffusers ControlNet: "
                                  f"{str(exc)[:200]}") from None
        size = sum(p.numel() * p.element_size() for p in module.parameters())
        self._fits(name, size, keep)
        self.loaded[name] = Loaded(module.to(self.pipeline.device).eval(), size)

    def _check_config(self, name: str, config: dict) -> None:
        """The folder is a ControlNet of this model's denoiser (the family says what must match:
        pipelines/control_inputs.py)."""
        problems = [p for p in self.pipeline.control_problems(config) if p]
        if problems:
            raise ControlNetError(f"ControlNet {name!r} does not fit {self.pipeline.info.name} "
                                  f"({self.pipeline.family}): {'; '.join(problems)}; allowed: ControlNets made for "
                                  f"this model")

    def _fits(self, name: str, size: int, keep: set[str]) -> None:
        if self.budget_bytes is None:
            return
        mib, budget = f"{size / 2**20:.3g} MiB", f"{self.budget_bytes / 2**20:.3g} MiB"
        if size > self.budget_bytes:
            raise ControlNetTooLargeError(f"ControlNet {name!r} ({mib}) is larger than the whole ControlNet "
                                          f"memory ({budget}, --controlnet-memory-mb): it can never be loaded")
        held = sum(c.bytes for n, c in self.loaded.items() if n in keep)
        if held + size > self.budget_bytes:
            raise ControlNetBudgetError(f"ControlNet {name!r} ({mib}) does not fit the ControlNet memory ({budget}) "
                                        f"beside the ControlNets this step uses; retry later")
        idle = sorted((n for n in self.loaded if n not in keep), key=lambda n: self.last_used.get(n, 0))
        while idle and self.loaded_bytes + size > self.budget_bytes:
            del self.loaded[idle.pop(0)]
            self.evictions += 1
