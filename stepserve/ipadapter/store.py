"""The IP-Adapters an executor serves: every sub-folder of the IP-Adapter folder holding an adapter's weights (one
`.safetensors` or `.bin` file with `image_proj.*` and `ip_adapter.*` keys, what diffusers' `load_ip_adapter` reads)
and its image encoder (`image_encoder/`, a CLIPVisionModelWithProjection) is servable by the sub-folder's name.

An adapter is loaded on first use: diffusers builds its attention processors and image projection
(UNet2DConditionModel._load_ip_adapter_weights), which are kept aside and put in the UNet only for the forwards that
have image-prompt rows (rows.py). Several are loaded at once within `budget_bytes` (--ip-adapter-memory-mb: the image
encoder, the projection and the IP processors of each), as ControlNets and LoRA adapters are: to make room, the
least recently used adapters that no request in flight uses are unloaded (they load again on their next use). The
rows of different adapters share one forward: `joined` gives the processors and projection of several adapters
together, as diffusers builds them for a list of adapters (rows.py gives each row its own adapter's scale).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from ..lora.folder import Watched
from .spec import unknown_name

ENCODER = "image_encoder"


class IPAdapterError(ValueError):
    """An IP-Adapter that cannot be named, loaded or served; the message says which and why."""

    def __init__(self, message: str, param: str = "ip_adapter") -> None:
        super().__init__(message)
        self.param = param


class IPAdapterBudgetError(IPAdapterError):
    """The adapter does not fit the IP-Adapter memory beside the adapters that requests in flight use: retry later."""


class IPAdapterTooLargeError(IPAdapterError):
    """Larger than the whole IP-Adapter memory (--ip-adapter-memory-mb): it can never be loaded."""


def weight_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin"))


def discover(root: Path | None) -> dict[str, Path]:
    """The folder's IP-Adapters by name: sub-folders with one weights file and an image_encoder/ config."""
    if root is None or not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir())
            if d.is_dir() and (d / ENCODER / "config.json").is_file() and len(weight_files(d)) == 1}


@dataclass
class Loaded:
    name: str
    processors: dict  # the UNet's attention processors with this adapter (IP processors on the cross-attentions)
    projection: torch.nn.Module  # diffusers' MultiIPAdapterImageProjection (the UNet's encoder_hid_proj)
    encoder: torch.nn.Module  # CLIPVisionModelWithProjection
    features: object  # CLIPImageProcessor: a picture -> the encoder's pixel values
    bytes: int


class IPAdapterStore:
    """IP-Adapters by name for one SD pipeline (`pipeline.unet`: the UNet they go into)."""

    def __init__(self, pipeline, root: str | Path | None, lock=None, budget_bytes: int | None = None) -> None:
        """`lock`: held while the UNet is changed (the executor's, which each stage holds); `budget_bytes`: the
        memory of the loaded adapters (None: no bound)."""
        self.pipeline = pipeline
        self.lock = lock if lock is not None else threading.RLock()
        self.root = Path(root).resolve() if root is not None else None
        self.budget_bytes = budget_bytes
        self.loaded: dict[str, Loaded] = {}
        self.last_used: dict[str, int] = {}
        self._uses = 0
        self._joined: dict[tuple[str, ...], tuple[dict, torch.nn.Module]] = {}  # several adapters' parts together
        self._users: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # requests given an embedding
        self.loads = 0
        self.evictions = 0
        self.mutex = threading.RLock()
        self._folder = Watched(self.root, discover)
        unet = pipeline.unet
        self.plain = dict(unet.attn_processors)  # the UNet's own processors, put back after each IP forward
        self._attention = {name: unet.get_submodule(name.rsplit(".", 1)[0]) for name in self.plain}

    def use(self, processors: dict) -> None:
        """Put `processors` (by name, as UNet2DConditionModel.attn_processors) in the UNet's attention modules:
        set_attn_processor's effect without its walk over every module."""
        for name, module in self._attention.items():
            module.set_processor(processors[name])

    def files(self) -> dict[str, Path]:
        return self._folder.files()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.files())

    def listing(self) -> list[dict]:
        """GET /v1/ip-adapters: every servable IP-Adapter, loaded or not."""
        loaded = dict(self.loaded)
        return [{"name": n, "loaded": n in loaded, "bytes": loaded[n].bytes if n in loaded else None}
                for n in sorted(self.names)]

    @property
    def loaded_bytes(self) -> int:
        return sum(a.bytes for a in self.loaded.values())

    def hold(self, request) -> None:
        """`request` carries an image prompt of a loaded adapter until it releases its tensors."""
        self._users[id(request)] = request

    def in_use(self) -> set[str]:
        """The adapters of the requests in flight (those that hold an embedding)."""
        return {e.name for r in list(self._users.values()) for e in r.image_prompt or ()}

    def ensure(self, name: str, keep=()) -> Loaded:
        """The adapter `name`, loaded (it counts as just used), unloading least recently used idle ones for room,
        never those of `keep` (the others a request needs beside it). Raises IPAdapterError (not served, not for
        this model), IPAdapterTooLargeError, IPAdapterBudgetError."""
        with self.mutex:
            self._uses += 1
            loaded = self.loaded.get(name)
            if loaded is not None:
                self.last_used[name] = self._uses
                return loaded
            folder = self.files().get(name)
            if folder is None:
                raise IPAdapterError(unknown_name(name, self.names), "ip_adapter.name")
        new = self._load(name, folder)  # the slow part outside the mutex (the UNet part under the stages' lock)
        with self.mutex:
            if name in self.loaded:  # another thread loaded it meanwhile
                return self.loaded[name]
            self._fits(name, new.bytes, set(keep))
            self.loaded[name] = new
            self.last_used[name] = self._uses
            self._joined.clear()
            self.loads += 1
            return new

    def _fits(self, name: str, size: int, keep: set[str]) -> None:
        if self.budget_bytes is None:
            return
        mib, budget = f"{size / 2**20:.3g} MiB", f"{self.budget_bytes / 2**20:.3g} MiB"
        if size > self.budget_bytes:
            raise IPAdapterTooLargeError(f"IP-Adapter {name!r} ({mib} with its image encoder) is larger than the "
                                         f"whole IP-Adapter memory ({budget}, --ip-adapter-memory-mb): it can "
                                         f"never be loaded")
        busy = self.in_use() | keep
        idle = sorted((n for n in self.loaded if n not in busy), key=lambda n: self.last_used.get(n, 0))
        while idle and self.loaded_bytes + size > self.budget_bytes:
            del self.loaded[idle.pop(0)]
            self.evictions += 1
            self._joined.clear()
        if self.loaded_bytes + size > self.budget_bytes:
            raise IPAdapterBudgetError(f"IP-Adapter {name!r} ({mib}) does not fit the IP-Adapter memory ({budget}, "
                                       f"--ip-adapter-memory-mb) beside the ones requests in flight (or this "
                                       f"request) use "
                                       f"({', '.join(sorted(busy))}); retry later")

    def joined(self, names: tuple[str, ...]) -> tuple[dict, torch.nn.Module]:
        """The attention processors (by name) and the image projection of the loaded adapters `names` together,
        in that order: what diffusers' _load_ip_adapter_weights builds for that list of adapters (each IP
        processor with one image key and value per adapter, the projection with one layer per adapter). Kept
        until the loaded set changes. Raises KeyError for one that is not loaded."""
        with self.mutex:
            hit = self._joined.get(names)
            if hit is not None:
                return hit
            parts = [self.loaded[n] for n in names]
            if len(parts) == 1:
                hit = parts[0].processors, parts[0].projection
            else:
                from diffusers.models.embeddings import MultiIPAdapterImageProjection

                processors = {attn: _joined([p.processors[attn] for p in parts]) for attn in self.plain}
                hit = processors, MultiIPAdapterImageProjection(
                    [layer for p in parts for layer in p.projection.image_projection_layers])
            self._joined[names] = hit
            return hit

    def _load(self, name: str, folder: Path) -> Loaded:
        from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

        p = self.pipeline
        state = _read(weight_files(folder)[0])
        try:
            encoder = CLIPVisionModelWithProjection.from_pretrained(folder / ENCODER, dtype=p.dtype).to(p.device)
        except (OSError, ValueError, RuntimeError) as exc:
            raise IPAdapterError(f"IP-Adapter {name!r}: its image encoder could not be read "
                                 f"({str(exc)[:200]})") from None
        encoder.eval()
        self._check(name, state, encoder)
        own = Path(p.folder) / "feature_extractor" if getattr(p, "folder", None) is not None else None
        if own is not None and (own / "preprocessor_config.json").is_file():  # the model's own, which diffusers' pipeline keeps
            features = CLIPImageProcessor.from_pretrained(own)
        else:  # what diffusers' load_ip_adapter makes for a pipeline without one
            size = encoder.config.image_size
            features = CLIPImageProcessor(size=size, crop_size=size)
        processors, projection = self._build(name, state)
        n = sum(t.numel() * t.element_size() for m in (encoder, projection) for t in m.parameters())
        n += sum(t.numel() * t.element_size() for proc in processors.values() if isinstance(proc, torch.nn.Module)
                 for t in proc.parameters())
        return Loaded(name, processors, projection, encoder, features, n)

    def _check(self, name: str, state: dict, encoder) -> None:
        unet = self.pipeline.unet
        proj = state["image_proj"].get("proj.weight")
        if proj is None:
            raise IPAdapterError(f"IP-Adapter {name!r} is not a plain IP-Adapter (its image projection has no "
                                 f"proj.weight: IP-Adapter Plus, FaceID and full variants are not served); allowed: "
                                 f"IP-Adapters with a linear image projection")
        problems = [
            f"its image tokens are {proj.shape[0] // 4} wide, the UNet's cross_attention_dim is "
            f"{unet.config.cross_attention_dim}" if proj.shape[0] != 4 * unet.config.cross_attention_dim else "",
            f"it takes image embeddings of {proj.shape[1]}, its image encoder gives "
            f"{encoder.config.projection_dim}" if proj.shape[1] != encoder.config.projection_dim else "",
        ]
        problems = [x for x in problems if x]
        if problems:
            raise IPAdapterError(f"IP-Adapter {name!r} does not fit {self.pipeline.info.name}: {'; '.join(problems)}"
                                 f"; allowed: IP-Adapters made for this model")

    def _build(self, name: str, state: dict) -> tuple[dict, torch.nn.Module]:
        """diffusers' own processors and projection for `state`, built in the UNet then taken out of it."""
        from .rows import RowScaled

        unet = self.pipeline.unet
        with self.lock:  # no forward runs while the UNet holds the adapter
            processors, projection = self._built(unet, state)
        for proc in processors.values():
            if hasattr(proc, "to_v_ip"):  # each row's own scale (rows.py); diffusers' scale stays 1
                proc.scale = [1.0]
                proc.to_v_ip[0] = RowScaled(proc.to_v_ip[0], name)
        return processors, projection

    def _built(self, unet, state: dict) -> tuple[dict, torch.nn.Module]:
        hid_proj, hid_type = unet.encoder_hid_proj, unet.config.encoder_hid_dim_type
        try:
            unet._load_ip_adapter_weights([state], low_cpu_mem_usage=False)
            processors, projection = dict(unet.attn_processors), unet.encoder_hid_proj
        except (KeyError, RuntimeError) as exc:
            raise IPAdapterError(f"IP-Adapter weights do not fit this UNet ({str(exc)[:200]}); allowed: "
                                 f"IP-Adapters made for {self.pipeline.info.name}") from None
        finally:
            unet.set_attn_processor(dict(self.plain))
            unet.encoder_hid_proj = hid_proj
            unet.config.encoder_hid_dim_type = hid_type
        return processors, projection


def _joined(processors: list) -> object:
    """One attention layer's processors of several adapters as one: an IP processor holds every adapter's image
    key and value in order (diffusers' IPAdapterAttnProcessor2_0 for a list of adapters, each scale 1: the rows'
    own scales are in RowScaled); a layer without image attention keeps the first's processor."""
    first = processors[0]
    if not hasattr(first, "to_k_ip"):
        return first
    out = type(first).__new__(type(first))
    torch.nn.Module.__init__(out)
    out.hidden_size, out.cross_attention_dim = first.hidden_size, first.cross_attention_dim
    out.num_tokens = [t for p in processors for t in p.num_tokens]
    out.scale = [1.0] * len(out.num_tokens)
    out.to_k_ip = torch.nn.ModuleList([m for p in processors for m in p.to_k_ip])
    out.to_v_ip = torch.nn.ModuleList([m for p in processors for m in p.to_v_ip])
    return out


def _read(file: Path) -> dict:
    """The adapter's state dict split as diffusers' load_ip_adapter splits it."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        state: dict = {"image_proj": {}, "ip_adapter": {}}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                head, _, rest = key.partition(".")
                if head in state:
                    state[head][rest] = f.get_tensor(key)
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not state.get("image_proj") or not state.get("ip_adapter"):
        raise IPAdapterError(f"{file.name} holds no IP-Adapter (image_proj.* and ip_adapter.* keys)")
    return state
