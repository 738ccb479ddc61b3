"""The adapters an executor serves: loaded from local files by diffusers' LoRA loaders into the denoiser (through
PEFT, inject.py), applied per row (rows.py), listed and deleted at run time.

Reading and converting a file happens outside the executor's lock; only the injection into the live modules and
the deletion take it, so a load waits for the step in flight and stalls the next one by the injection alone.

The adapter cache: with a folder (`root`), every adapter in it (folder.py) is servable by its name; it is loaded
when a request first names it (`ensure`, called by the front end before the request is queued: the request waits
there, never in a batch). Loaded adapters live in device memory within `budget_bytes`, which counts each adapter's
weights and its slots in the per-layer stacks a mixed batch gathers from. The add-ons' one budgeted store decides
(stepserve/addons/store.py, as for ControlNets and IP-Adapters): to make room, the least recently used adapter
that no request in the engine carries is unloaded (it loads again on its next use, from the file it was loaded
from); a load is checked (name, path, file, size) before anything is unloaded for it; one larger than the whole
memory is remembered (refused again without reading its file until the file changes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..addons import sizes
from ..addons.store import AddonBudget, Kind
from . import folder
from .errors import LoraBudgetError, LoraError, LoraInUseError, LoraTooLargeError, does_not_fit, not_loaded
from .inject import Injector, check_served, key_for, require_peft
from .rows import drop_stacks, hook, stack_bytes

MAX_ADAPTERS = 64  # adapters loaded at once (each adds its low-rank weights to every adapted layer)
# param None: the errors' own ("name", what POST /v1/loras reads; a request's admission names "loras" itself)
KIND = Kind("adapter", "adapters", "adapter memory", "--lora-memory-mb", LoraTooLargeError, LoraBudgetError, None)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str  # relative to the adapter folder
    rank: int  # the largest rank over its layers
    layers: int  # adapted layers (the denoiser's and the text encoders')
    bytes: int  # its low-rank weights
    text_encoder: bool = False  # it adapts a text encoder too (prompts are then encoded with it)
    stack_bytes: int = 0  # its slots in the per-layer stacks of mixed batches (counted in the budget too)


class AdapterStore:
    """Adapters by name for one family adapter's denoiser (`pipeline.lora_loader`: the diffusers loader mixin and
    the denoiser's attribute name; the module lives on pipeline.networks)."""

    def __init__(self, pipeline, lock: threading.RLock | None = None, root: str | Path | None = None,
                 budget_bytes: int | None = None) -> None:
        self.injector = Injector(pipeline)
        self.module = self.injector.module
        self.lock = lock or threading.RLock()
        self.root = Path(root).resolve() if root is not None else None
        self.adapters: dict[str, AdapterInfo] = {}
        self.keys: dict[str, str] = {}  # name -> the modules' key for it (inject.key_for)
        self.sources: dict[str, Path] = {}  # name -> the file it was loaded from, where that is not the folder's
        # file of that name (kept when evicted: it reloads from there)
        self.retired: set[str] = set()  # being deleted: no new request may name them
        # device memory for loaded adapters (None: no bound) and which to unload for room
        self.budget = AddonBudget(KIND, self._unload, budget_bytes, MAX_ADAPTERS)
        self._serial = 0
        self.version = 0  # bumped at every change (the executor's ModelInfo lists the names)
        self._hooked: set[int] = set()
        self._files: tuple = (object(), {})  # (folder stamp, files) of the last look at the folder
        self._mutex = threading.RLock()  # one load, delete or cache decision at a time (a name is never half-loaded)
        # name -> a path in the folder, or None: adapters registered elsewhere (the server wires its state store);
        # asked off the event loop when a request names an adapter this store does not serve (gate.resolve)
        self.resolver: Callable[[str], str | None] | None = None

    budget_bytes = property(lambda self: self.budget.budget_bytes,
                            lambda self, value: setattr(self.budget, "budget_bytes", value))
    last_used = property(lambda self: self.budget.last_used)
    evictions = property(lambda self: self.budget.evictions)

    @property
    def names(self) -> frozenset[str]:
        """The adapters a new request may name: loaded ones, evicted ones (they reload from their file), and the
        folder's (loaded on first use)."""
        return (frozenset(self.adapters) | frozenset(self.sources) | frozenset(self.files())) - frozenset(self.retired)

    def folder_stamp(self):
        """Changes when adapters are added to or removed from the folder."""
        return folder.stamp(self.root)

    def files(self) -> dict[str, Path]:
        """Servable adapters of the folder and its subfolders, by name (folder.py)."""
        if self.root is None:
            return {}
        stamp = folder.stamp(self.root)
        if self._files[0] != stamp or stamp is None:
            self._files = (stamp, folder.discover(self.root) if stamp is not None else {})
        return dict(self._files[1])

    @property
    def loaded_bytes(self) -> int:
        return self.budget.loaded_bytes

    def ensure(self, names, in_use=frozenset()) -> None:
        """Load the adapters among `names` that are not loaded (from the file each was last loaded from, else the
        folder's), unloading the least recently used ones that `in_use` (carried by requests in the engine) does
        not hold when the budget needs room. Raises LoraError: LoraTooLargeError (it can never fit),
        LoraBudgetError (not beside those in use: retry later)."""
        with self._mutex:
            self.budget.touch(names)
            files = self.files()
            for name in [n for n in dict.fromkeys(names) if n not in self.adapters]:
                source = self.sources.get(name, files.get(name))
                if source is None:
                    raise not_loaded(name, self.names)
                self._admit(name, source, own=set(names), busy=set(in_use))

    def load_within_budget(self, name: str, path: str | Path, in_use=frozenset()) -> AdapterInfo:
        """Load `path` as `name` (POST /v1/loras), unloading least recently used idle adapters for room; it counts
        as just used. Raises LoraError as ensure() does; nothing is unloaded for a load that fails its checks."""
        with self._mutex:
            info = self._admit(name, path, busy=set(in_use))
            self.budget.touch([name])
            return info

    def register(self, name: str, path: str | Path) -> bool:
        """Serve `path` (in the folder) as `name` from now on, loaded on first use as an evicted adapter reloads:
        nothing is read now. False when it is served so already; LoraInUseError when `name` is loaded (or being
        deleted) with another file; LoraError for a name or path a load could not use."""
        with self._mutex:
            folder.check_name(name)
            file = folder.check_path(self.root, path)
            if self.sources.get(name, self.files().get(name)) == file:
                return False
            if name in self.adapters or name in self.retired:
                raise LoraInUseError(f"adapter {name!r} is loaded from another file; delete it first to serve "
                                     f"{folder.shown(self.root, file)} as it")
            if self.files().get(name) == file:
                self.sources.pop(name, None)
            else:
                self.sources[name] = file
            self.version += 1
            return True

    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Read `path` (safetensors: diffusers/PEFT, kohya, ... as diffusers reads them; or a folder holding
        pytorch_lora_weights.safetensors) and serve it as `name`, within the budget; nothing is unloaded for it."""
        with self._mutex:
            return self._admit(name, path, busy=set(self.adapters))

    def _admit(self, name: str, path: str | Path, own: set[str] = frozenset(), busy: set[str] = frozenset()
               ) -> AdapterInfo:
        """The one "fit in the budget or undo": check, read, size, make room, inject, account. `own`: the other
        adapters of the request that names it; `busy`: adapters in use (nothing of either is unloaded for it)."""
        folder.check_name(name)
        if name in self.adapters:
            raise LoraInUseError(f"adapter {name!r} is already loaded; delete it first to load another file as it")
        file = folder.check_path(self.root, path)
        require_peft()
        shown = folder.shown(self.root, file)
        stamp = sizes.stamp([file])
        self.budget.remembered(name, stamp)  # found too large before: refused without reading the file again
        try:
            state_dict, alphas, metadata = self.injector.read(file)
        except Exception as exc:  # noqa: BLE001 - diffusers raises many kinds for a file it cannot read
            raise LoraError(f"adapter {name!r}: {shown} is not a LoRA file diffusers reads: "
                            f"{folder.scrub(str(exc), self.root, file)}", "path") from None
        unknown = self.injector.unknown_parts(state_dict)
        if unknown:
            have = [self.injector.module_name] + [p for p, _ in self.injector.text_encoders(None)]
            raise LoraError(f"adapter {name!r}: {shown} adapts {', '.join(unknown)}, which this model does not have "
                            f"(it has {', '.join(have)}): is it made for another model family?", "path")
        # weights, and as much in stacks: reserved before anything is unloaded or injected for it
        self.budget.reserve(name, 2 * self.injector.estimate_bytes(state_dict), own, busy, stamp)
        self._serial += 1
        key = key_for(name, self._serial)
        with self.lock:
            try:
                self.injector.inject(state_dict, alphas, metadata, key)
                layers = self.injector.layers(key)
                if not layers:
                    raise LoraError(f"adapter {name!r}: no layer of this model matches {shown}; is it made for "
                                    f"another model family?", "path")
                check_served(layers, key, name, shown)
            except Exception as exc:  # noqa: BLE001
                self.injector.forget(key)
                self.budget.cancel(name)
                if isinstance(exc, LoraError):
                    raise
                raise does_not_fit(name, shown, self.injector.module_name,
                                   folder.scrub(str(exc), self.root, file)) from None
            drop_stacks(layers)
            for layer in layers:
                layer.enable_adapters(False)  # PEFT's own application off: rows.hook applies it per row
                if id(layer) not in self._hooked:
                    layer.register_forward_hook(hook)
                    self._hooked.add(id(layer))
            info = AdapterInfo(name, shown, max(int(layer.r[key]) for layer in layers), len(layers),
                               sum(p.numel() * p.element_size() for layer in layers
                                   for p in (*layer.lora_A[key].parameters(), *layer.lora_B[key].parameters())),
                               text_encoder=bool(self.injector.text_encoders(state_dict)),
                               stack_bytes=stack_bytes(layers, key))
            self.adapters[name], self.keys[name] = info, key
            self.version += 1
        try:
            self.budget.settle(name, info.bytes + info.stack_bytes, own, busy, stamp)
        except LoraError:
            self._unload(name)
            raise
        if self.files().get(name) == file:  # the folder's own: it reloads from there while the file is there
            self.sources.pop(name, None)
        else:  # loaded from elsewhere (POST): it reloads from its own file
            self.sources[name] = file
        return info

    def retire(self, name: str) -> None:
        """No new request may name `name` (the first half of a deletion while serving)."""
        if (name not in self.adapters and name not in self.sources) or name in self.retired:
            raise not_loaded(name, self.names)
        self.retired.add(name)
        self.version += 1

    def unretire(self, name: str) -> None:
        self.retired.discard(name)
        self.version += 1

    def check_path(self, path: str | Path) -> Path:
        """`path` resolved to an adapter file inside the folder (when there is one); LoraError where it cannot be."""
        return folder.check_path(self.root, path)

    def delete(self, name: str) -> None:
        """Unload `name` (when loaded: an evicted one is only forgotten) and forget where it came from (a folder
        adapter of that name stays servable)."""
        with self._mutex:
            if name not in self.adapters and name not in self.sources:
                raise not_loaded(name, self.adapters)
            if name in self.adapters:
                self._unload(name)
            self.sources.pop(name, None)
            self.budget.last_used.pop(name, None)
            self.retired.discard(name)
            self.version += 1

    def _unload(self, name: str) -> None:
        """Free `name`'s weights and its stacks; where it came from is kept (it reloads from there when named)."""
        with self.lock:
            key = self.keys.pop(name)
            layers = self.injector.layers(key)
            self.injector.forget(key)
            drop_stacks(layers)
            del self.adapters[name]
            self.budget.drop(name)
            self.version += 1

    # --- what the executor asks (names -> the modules' keys) ------------------------------------------------------
    def key_rows(self, rows):
        """Rows of (name, scale) -> rows of (key, scale): what rows.adapter_rows / every_row apply."""
        return [tuple((self.keys[n], s) for n, s in row) if row else row for row in rows]

    def text_adapters(self, loras) -> tuple:
        """Of a request's (name, scale) pairs, those whose adapters adapt a text encoder, as (key, scale)."""
        return tuple((self.keys[n], s) for n, s in (loras or ()) if n in self.adapters
                     and self.adapters[n].text_encoder)

    def missing(self, loras_lists) -> list[str]:
        return sorted({n for loras in loras_lists for n, _ in (loras or ()) if n not in self.adapters})
