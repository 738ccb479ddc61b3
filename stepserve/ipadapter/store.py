"""The IP-Adapters an executor serves: every sub-folder of the IP-Adapter folder holding an adapter's weights (one
`.safetensors` or `.bin` file with `image_proj.*` and `ip_adapter.*` keys, what diffusers' `load_ip_adapter` reads)
and its image encoder (`image_encoder/`, a CLIPVisionModelWithProjection) is servable by the sub-folder's name.

One adapter is loaded at a time, on first use: diffusers builds its attention processors and image projection
(UNet2DConditionModel._load_ip_adapter_weights), which are kept aside and put in the UNet only for the forwards that
have image-prompt rows (rows.py). Another adapter replaces it when no request in flight uses it.
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


class IPAdapterBusyError(IPAdapterError):
    """Another IP-Adapter serves requests in flight (one is loaded at a time): retry later."""


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

    def __init__(self, pipeline, root: str | Path | None, lock=None) -> None:
        """`lock`: held while the UNet is changed (the executor's, which each stage holds)."""
        self.pipeline = pipeline
        self.lock = lock if lock is not None else threading.RLock()
        self.root = Path(root).resolve() if root is not None else None
        self.loaded: Loaded | None = None
        self._users: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # requests given an embedding
        self.loads = 0
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
        loaded = self.loaded
        return [{"name": n, "loaded": loaded is not None and loaded.name == n,
                 "bytes": loaded.bytes if loaded is not None and loaded.name == n else None}
                for n in sorted(self.names)]

    def hold(self, request) -> None:
        """`request` carries an image prompt of the loaded adapter until it releases its tensors."""
        self._users[id(request)] = request

    def in_use(self) -> set[str]:
        """The adapters of the requests in flight (those that hold an embedding)."""
        return {r.image_prompt.name for r in list(self._users.values()) if r.image_prompt is not None}

    def ensure(self, name: str) -> Loaded:
        """The adapter `name`, loaded in place of the loaded one unless a request in flight uses that one. Raises
        IPAdapterError (not served, not for this model), IPAdapterBusyError."""
        with self.mutex:
            loaded = self.loaded
            if loaded is not None and loaded.name == name:
                return loaded
            folder = self.files().get(name)
            if folder is None:
                raise IPAdapterError(unknown_name(name, self.names), "ip_adapter.name")
            self._free(name)
        new = self._load(name, folder)  # the slow part outside the mutex (the UNet part under the stages' lock)
        with self.mutex:
            if self.loaded is not None and self.loaded.name == name:  # another thread loaded it meanwhile
                return self.loaded
            self._free(name)
            self.loaded = new
            self.loads += 1
            return new

    def _free(self, name: str) -> None:
        loaded = self.loaded
        if loaded is not None and loaded.name in self.in_use():
            raise IPAdapterBusyError(f"IP-Adapter {name!r} cannot be loaded while {loaded.name!r} serves requests "
                                     f"in flight (one IP-Adapter is loaded at a time); retry later")

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
        processors, projection = self._build(state)
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

    def _build(self, state: dict) -> tuple[dict, torch.nn.Module]:
        """diffusers' own processors and projection for `state`, built in the UNet then taken out of it."""
        from .rows import RowScaled

        unet = self.pipeline.unet
        with self.lock:  # no forward runs while the UNet holds the adapter
            processors, projection = self._built(unet, state)
        for proc in processors.values():
            if hasattr(proc, "to_v_ip"):  # each row's own scale (rows.py); diffusers' scale stays 1
                proc.scale = [1.0]
                proc.to_v_ip[0] = RowScaled(proc.to_v_ip[0])
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
