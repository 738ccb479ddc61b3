"""The adapters an executor serves: loaded from local files by diffusers' LoRA loaders into the denoiser (through
PEFT), applied per row (rows.py), listed and deleted at run time.

Reading and converting a file happens outside the executor's lock; only the injection into the live modules and
the deletion take it, so a load waits for the step in flight and stalls the next one by the injection alone.

The adapter cache: with a folder (`root`), every *.safetensors in it is servable by its name; it is loaded when a
request first names it (`ensure`, called by the front end before the request is queued: the request waits there,
never in a batch). Loaded adapters live in device memory within `budget_bytes`; to make room, the least recently
used adapter that no request in the engine carries is unloaded (it loads again on its next use).
"""

from __future__ import annotations

import importlib
import inspect
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import LoraBudgetError, LoraError
from .rows import bump_generation, hook

MAX_ADAPTERS = 64  # adapters loaded at once (each adds its low-rank weights to every adapted layer)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int  # the largest rank over its layers
    layers: int  # adapted layers (the denoiser's and the text encoders')
    bytes: int  # its low-rank weights
    text_encoder: bool = False  # it adapts a text encoder too (prompts are then encoded with it)


class AdapterStore:
    """Adapters by name for one family adapter's denoiser (`pipeline.lora_loader`: the diffusers loader mixin and
    the denoiser's attribute name; the module lives on pipeline.networks)."""

    def __init__(self, pipeline, lock: threading.RLock | None = None, root: str | Path | None = None,
                 budget_bytes: int | None = None) -> None:
        spec = getattr(pipeline, "lora_loader", None)
        module_name = spec[1] if spec else None
        self.module = getattr(pipeline.networks, module_name, None) if module_name else None
        if self.module is None:
            raise LoraError(f"{pipeline.info.family} on this backend serves no LoRA adapters (torch backend only, "
                            f"families: sd, sdxl, sd3, flux, flux2, qwenimage)")
        mixin_path, self.module_name = spec
        self.networks = pipeline.networks
        module, _, cls = mixin_path.partition(":")
        self.mixin = getattr(importlib.import_module(module), cls)
        self.lock = lock or threading.RLock()
        self.root = Path(root).resolve() if root is not None else None
        self.adapters: dict[str, AdapterInfo] = {}
        self.retired: set[str] = set()  # being deleted: no new request may name them
        self.budget_bytes = budget_bytes  # device memory for loaded adapters (None: no bound)
        self.last_used: dict[str, int] = {}  # name -> use counter at its last use (least recently used goes first)
        self._uses = 0
        self.evictions = 0
        self.version = 0  # bumped at every change (the executor's ModelInfo lists the names)
        self._hooked: set[int] = set()
        self._mutex = threading.RLock()  # one load, delete or cache decision at a time (a name is never half-loaded)

    @property
    def names(self) -> frozenset[str]:
        """The adapters a new request may name: loaded ones, and the files of the folder (loaded on first use)."""
        return (frozenset(self.adapters) | frozenset(self.files())) - frozenset(self.retired)

    def folder_stamp(self):
        """Changes when files are added to or removed from the folder (its modification time)."""
        try:
            return self.root.stat().st_mtime_ns if self.root is not None else None
        except OSError:
            return None

    def files(self) -> dict[str, Path]:
        """Servable adapter files of the folder, by name."""
        if self.root is None:
            return {}
        return {f.stem: f for f in sorted(self.root.glob("*.safetensors"))}

    @property
    def loaded_bytes(self) -> int:
        return sum(a.bytes for a in self.adapters.values())

    def ensure(self, names, in_use=frozenset()) -> None:
        """Load the folder's adapters among `names` that are not loaded, unloading the least recently used ones that
        `in_use` (carried by requests in the engine) does not hold when the budget needs room. Raises LoraError when
        the budget cannot hold them."""
        with self._mutex:
            self._ensure(names, in_use)

    def _ensure(self, names, in_use) -> None:
        self._uses += 1
        for name in names:
            self.last_used[name] = self._uses
        missing = [n for n in dict.fromkeys(names) if n not in self.adapters]
        files = self.files()
        for name in missing:
            if name not in files:
                raise LoraError(f"adapter {name!r} is not loaded; loaded: {', '.join(sorted(self.names)) or 'none'}")
            self._make_room(keep=set(names) | set(in_use), extra=1)
            info = self.load(name, files[name])
            self._make_room(keep=set(names) | set(in_use))
            if self.budget_bytes is not None and self.loaded_bytes > self.budget_bytes:
                self.delete(name)
                raise LoraBudgetError(f"adapter {name!r} ({info.bytes / 2**20:.1f} MiB) does not fit the adapter memory "
                                f"budget ({self.budget_bytes / 2**20:.0f} MiB) beside the adapters requests are "
                                f"using; retry later")

    def _make_room(self, keep: set[str], extra: int = 0) -> None:
        """Unload least recently used adapters outside `keep` while the memory budget is exceeded, or while `extra`
        more would exceed the count (MAX_ADAPTERS)."""
        idle = sorted((n for n in self.adapters if n not in keep), key=lambda n: self.last_used.get(n, 0))
        while idle and ((self.budget_bytes is not None and self.loaded_bytes > self.budget_bytes)
                        or len(self.adapters) + extra > MAX_ADAPTERS):
            self.delete(idle.pop(0))
            self.evictions += 1

    def load_within_budget(self, name: str, path: str | Path, in_use=frozenset()) -> AdapterInfo:
        """load(), then unload least recently used idle adapters for room (POST /v1/loras): the new adapter counts
        as just used. Raises LoraBudgetError (and unloads it) when it does not fit beside those in use."""
        with self._mutex:
            self._make_room(keep=set(in_use), extra=1)
            info = self.load(name, path)
            self._uses += 1
            self.last_used[name] = self._uses
            self._make_room(keep=set(in_use) | {name})
            if self.budget_bytes is not None and self.loaded_bytes > self.budget_bytes:
                self.delete(name)
                raise LoraBudgetError(f"adapter {name!r} ({info.bytes / 2**20:.1f} MiB) does not fit the adapter "
                                      f"memory budget ({self.budget_bytes / 2**20:.0f} MiB) beside the adapters in "
                                      f"use; retry later")
            return info

    def retire(self, name: str) -> None:
        """No new request may name `name` (the first half of a deletion while serving)."""
        if name not in self.adapters or name in self.retired:
            raise LoraError(f"adapter {name!r} is not loaded; loaded: {', '.join(sorted(self.names)) or 'none'}")
        self.retired.add(name)
        self.version += 1

    def unretire(self, name: str) -> None:
        self.retired.discard(name)
        self.version += 1

    def check_path(self, path: str | Path) -> Path:
        """`path` resolved; inside the allowed folder (when there is one), an existing file."""
        resolved = (self.root / path if self.root is not None and not Path(path).is_absolute() else Path(path))
        resolved = resolved.resolve()
        if self.root is not None and self.root not in resolved.parents:
            raise LoraError(f"path {str(path)!r} is outside the adapter folder {self.root}; allowed: files in it")
        if not resolved.is_file():
            raise LoraError(f"path {str(path)!r}: no such file")
        return resolved

    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Read `path` (safetensors: diffusers/PEFT, kohya, ... as diffusers reads them) and serve it as `name`."""
        with self._mutex:
            return self._load(name, path)

    def _load(self, name: str, path: str | Path) -> AdapterInfo:
        if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "-_." for c in name):
            raise LoraError(f"name {name!r}: 1-64 characters of letters, digits, '-', '_' and '.'")
        if name in self.adapters:
            raise LoraError(f"adapter {name!r} is already loaded; delete it first to load another file as it")
        if len(self.adapters) >= MAX_ADAPTERS:
            raise LoraBudgetError(f"{MAX_ADAPTERS} adapters are loaded, the most served at once; delete one first")
        file = self.check_path(path)
        try:
            state_dict, alphas, metadata = self._read(file)
        except Exception as exc:  # noqa: BLE001 - diffusers raises many kinds for a file it cannot read
            raise LoraError(f"adapter {name!r}: {file.name} is not a LoRA file diffusers reads: {exc}") from None
        encoders = self._text_encoders(state_dict)
        unknown = sorted({k.split(".", 1)[0] for k in state_dict} - {self.module_name} - {p for p, _ in encoders})
        if unknown:
            raise LoraError(f"adapter {name!r}: {file.name} adapts {', '.join(unknown)}, which this model does not "
                            f"have (it has {', '.join([self.module_name] + [p for p, _ in self._text_encoders(None)])}): "
                            f"is it made for another model family?")
        with self.lock:
            before = self._adapted_layers(name)
            try:
                with warnings.catch_warnings():  # PEFT warns that a model holds several adapters: that is the point
                    warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                    self._inject(state_dict, alphas, metadata, name, encoders)
            except Exception as exc:  # noqa: BLE001
                self._forget(name)
                raise LoraError(f"adapter {name!r}: {file.name} does not fit this model: {exc}") from None
            layers = self._adapted_layers(name)
            if not [m for m in self.module.modules() if hasattr(m, "lora_A") and name in m.lora_A] or before:
                self._forget(name)
                raise LoraError(f"adapter {name!r}: no layer of this model matches {file.name}; is it made for "
                                f"another model family?")
            unsupported = [layer for layer in layers if (getattr(layer, "use_dora", {}) or {}).get(name)
                           or getattr(layer.lora_B[name], "bias", None) is not None]
            if unsupported:
                self._forget(name)
                raise LoraError(f"adapter {name!r}: {file.name} uses DoRA or a bias on lora_B, which are not served "
                                f"(plain LoRA only)")
            for layer in layers:
                layer.enable_adapters(False)  # PEFT's own application off: rows.hook applies it per row
                if id(layer) not in self._hooked:
                    layer.register_forward_hook(hook)
                    self._hooked.add(id(layer))
            info = AdapterInfo(name, str(file), max(int(layer.r[name]) for layer in layers), len(layers),
                               sum(p.numel() * p.element_size() for layer in layers
                                   for p in (*layer.lora_A[name].parameters(), *layer.lora_B[name].parameters())),
                               text_encoder=bool(encoders))
            self.adapters[name] = info
            self.version += 1
            bump_generation()  # per-layer stacks and per-adapter-set prompt caches are rebuilt
        return info

    def delete(self, name: str) -> None:
        with self._mutex:
            if name not in self.adapters:
                raise LoraError(f"adapter {name!r} is not loaded; loaded: "
                                f"{', '.join(sorted(self.adapters)) or 'none'}")
            with self.lock:
                self._forget(name)
                del self.adapters[name]
                self.retired.discard(name)
                self.last_used.pop(name, None)
                self.version += 1
                bump_generation()

    def _forget(self, name: str) -> None:
        for module in self._modules():
            if any(hasattr(m, "lora_A") and name in m.lora_A for m in module.modules()):
                if hasattr(module, "delete_adapters"):
                    module.delete_adapters(name)
                else:  # a transformers text encoder: PEFT's layers, and its peft_config (so the name loads again)
                    from peft.tuners.tuners_utils import BaseTunerLayer

                    for m in module.modules():
                        if isinstance(m, BaseTunerLayer) and name in m.lora_A:
                            m.delete_adapter(name)
                    (getattr(module, "peft_config", None) or {}).pop(name, None)

    def _modules(self) -> list:
        """The denoiser and the text encoders adapters may adapt."""
        return [self.module] + [m for _, m in self._text_encoders(None)]

    def _adapted_layers(self, name: str) -> list:
        return [m for module in self._modules() for m in module.modules() if hasattr(m, "lora_A") and name in m.lora_A]

    def _text_encoders(self, state_dict: dict | None) -> list[tuple[str, object]]:
        """(prefix, module) of the text encoders (those `state_dict` adapts, when given) this model has."""
        out = []
        for prefix in ("text_encoder", "text_encoder_2"):
            module = getattr(self.networks, prefix, None)
            if module is not None and (state_dict is None or any(k.startswith(prefix + ".") for k in state_dict)):
                out.append((prefix, module))
        return out

    def _read(self, file: Path) -> tuple[dict, dict | None, dict | None]:
        """(state dict in diffusers' naming, network alphas, adapter metadata) as the family's loader reads them."""
        params = inspect.signature(self.mixin.lora_state_dict).parameters
        kwargs = {}
        if "return_alphas" in params:
            kwargs["return_alphas"] = True
        kwargs["return_lora_metadata"] = True
        out = self.mixin.lora_state_dict(str(file), **kwargs)
        out = out if isinstance(out, tuple) else (out,)
        state_dict = out[0]
        alphas = out[1] if len(out) > 2 else None
        metadata = out[-1] if len(out) > 1 else None
        return state_dict, alphas, metadata

    def _inject(self, state_dict: dict, alphas: dict | None, metadata: dict | None, name: str,
                encoders: list[tuple[str, object]]) -> None:
        """The family's `load_lora_into_unet` / `load_lora_into_transformer` on the live denoiser, and its
        `load_lora_into_text_encoder` on each text encoder the file adapts (as its load_lora_weights calls them)."""
        denoiser = {k: v for k, v in state_dict.items() if not any(k.startswith(p + ".") for p, _ in encoders)}
        self._call(f"load_lora_into_{self.module_name}", denoiser, alphas, metadata, name,
                   **{self.module_name: self.module})
        for prefix, module in encoders:
            self._call("load_lora_into_text_encoder", state_dict, alphas, metadata, name, text_encoder=module,
                       prefix=prefix)
        for module in [m for _, m in encoders]:  # transformers' models: switch PEFT's application off per layer
            for layer in module.modules():
                if hasattr(layer, "lora_A") and name in layer.lora_A:
                    layer.enable_adapters(False)

    def _call(self, method_name: str, state_dict: dict, alphas, metadata, name: str, **modules) -> None:
        method = getattr(self.mixin, method_name)
        params = inspect.signature(method).parameters
        kwargs = {**modules, "adapter_name": name}
        for key, value in (("network_alphas", alphas), ("metadata", metadata), ("_pipeline", None)):
            if key in params:
                kwargs[key] = value
        method(dict(state_dict), **kwargs)
