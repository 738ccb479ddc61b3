"""The IP-Adapters an executor serves: every sub-folder of the IP-Adapter folder holding an adapter's weights (one
`.safetensors` or `.bin` file with `image_proj.*` and `ip_adapter.*` keys, what diffusers' `load_ip_adapter` reads)
and its image encoder (`image_encoder/`, a CLIPVisionModelWithProjection) is servable by the sub-folder's name.

An adapter is loaded on first use: diffusers builds its attention processors and image projection
(UNet2DConditionModel._load_ip_adapter_weights), which are kept aside and put in the UNet only for the forwards that
have image-prompt rows (rows.py). Several are loaded at once within `budget_bytes` (--ip-adapter-memory-mb: the image
encoder, the projection and the IP processors of each), decided by the add-ons' one budgeted store
(stepserve/addons/store.py) as for ControlNets and LoRA adapters: an adapter's size is read from its files' headers
before anything is read; one larger than the whole memory is refused without a load, and remembered; to make room,
the least recently used adapters that no request in flight uses are unloaded (they load again on their next use).
Adapters whose image encoders are the same (parts.encoder_part) share one loaded copy, as diffusers' pipeline keeps
one image encoder for all its adapters: a shared part of the store, unloaded with the last adapter that needs it. The
rows of different adapters share one forward: `joined` gives the processors and projection of several adapters
together, as diffusers builds them for a list of adapters (rows.py gives each row its own adapter's scale).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from ..addons import sizes
from ..addons.store import AddonBudget, Holder, Kind
from ..lora.folder import Watched
from .parts import (ENCODER, IPAdapterBudgetError, IPAdapterError, IPAdapterTooLargeError, Loaded, Parts,
                    discover, encoder_part, files_of, joined_processor, read_weights, sizes_of, weight_files)
from .spec import unknown_name

KIND = Kind("IP-Adapter", "IP-Adapters", "IP-Adapter memory", "--ip-adapter-memory-mb", IPAdapterTooLargeError,
            IPAdapterBudgetError, "ip_adapter")


class IPAdapterStore:
    """IP-Adapters by name for one SD pipeline (`pipeline.unet`: the UNet they go into)."""

    def __init__(self, pipeline, root: str | Path | None, lock=None, budget_bytes: int | None = None) -> None:
        """`lock`: held while the UNet is changed (the executor's, which each stage holds); `budget_bytes`: the
        memory of the loaded adapters (None: no bound)."""
        self.pipeline = pipeline
        self.lock = lock if lock is not None else threading.RLock()
        self.root = Path(root).resolve() if root is not None else None
        self.loaded: dict[str, Loaded] = {}
        self.encoders: dict[str, torch.nn.Module] = {}  # image encoders by part name, one copy for all that share it
        self._joined: dict[tuple[str, ...], tuple[dict, torch.nn.Module]] = {}  # several adapters' parts together
        self.budget = AddonBudget(KIND, self._unload, budget_bytes)
        self.mutex = self.budget.mutex
        self._folder = Watched(self.root, discover)
        unet = pipeline.unet
        self.plain = dict(unet.attn_processors)  # the UNet's own processors, put back after each IP forward
        self._attention = {name: unet.get_submodule(name.rsplit(".", 1)[0]) for name in self.plain}

    budget_bytes = property(lambda self: self.budget.budget_bytes,
                            lambda self, value: setattr(self.budget, "budget_bytes", value))
    loads = property(lambda self: self.budget.loads)
    evictions = property(lambda self: self.budget.evictions)
    last_used = property(lambda self: self.budget.last_used)

    def _unload(self, name: str) -> None:
        """Free an adapter, or an image encoder (once no loaded adapter needs it: the budget's shared parts)."""
        if self.encoders.pop(name, None) is None:
            self.loaded.pop(name, None)
            self._joined.clear()

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
        return self.budget.loaded_bytes

    @contextlib.contextmanager
    def starting(self, names) -> Iterator[None]:
        """While requests get their embeddings: their adapters are not unloaded for another (rows.prepare)."""
        token = Holder()
        self.budget.hold(token, names)
        try:
            yield
        finally:
            self.budget.release(token)

    def hold(self, request) -> None:
        """`request` carries an image prompt of loaded adapters until it finishes (or is dropped)."""
        self.budget.hold(request, [e.name for e in request.image_prompt or ()])

    def in_use(self) -> set[str]:
        """The adapters of the requests in flight (those that hold an embedding) and of those starting."""
        return self.budget.in_use()

    def ensure(self, name: str, keep=()) -> Loaded:
        """The adapter `name`, loaded (it counts as just used), unloading least recently used idle ones for room,
        never those of `keep` (the others a request needs beside it). Its size is read from its files before
        anything is read or goes to the device. Raises IPAdapterError (not served, not for this model),
        IPAdapterTooLargeError (it, or it with the others of `keep`, can never fit), IPAdapterBudgetError (not
        now: retry later)."""
        with self.mutex:
            loaded = self.loaded.get(name)
            if loaded is not None:
                self.budget.touch([name])
                return loaded
            folder = self.files().get(name)
            if folder is None:
                raise IPAdapterError(unknown_name(name, self.names), "ip_adapter.name")
            stamp = sizes.stamp(files_of(folder))
            self.budget.remembered(name, stamp)  # found too large before: refused without reading anything
            width = torch.empty((), dtype=self.pipeline.dtype).element_size()
            try:
                size, encoder_size = sizes_of(folder, width)
                part = encoder_part(folder)
            except (OSError, ValueError) as exc:
                raise IPAdapterError(f"IP-Adapter {name!r}: its files cannot be read ({exc}); allowed: folders "
                                     f"with one IP-Adapter weights file and an image_encoder/") from None
            self.budget.needs[name] = frozenset([part])
            shared = self.encoders.get(part)  # loaded for another adapter: this one uses that copy
            own = set(keep) - {name}
            self.budget.reserve(name, size + (0 if shared is not None else encoder_size), own, stamp=stamp)
        try:  # on the CPU, then to the device and the UNet part (under the stages' lock), outside the mutex
            parts = self._read_parts(name, folder, shared)
            new = self._place(name, parts, part)
        except BaseException:
            self.budget.cancel(name)
            raise
        with self.mutex:
            if name in self.loaded:  # another thread loaded it meanwhile
                self.budget.cancel(name)
                return self.loaded[name]
            first = part not in self.encoders
            if not first:  # another adapter loaded the same encoder meanwhile: use that copy
                new.encoder = self.encoders[part]
            self.budget.settle(name, parts.bytes, own, stamp=stamp, parts={part: parts.encoder_bytes} if first else {})
            self.encoders[part] = new.encoder
            self.loaded[name] = new
            self._joined.clear()
            return new

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

                processors = {attn: joined_processor([p.processors[attn] for p in parts]) for attn in self.plain}
                hit = processors, MultiIPAdapterImageProjection(
                    [layer for p in parts for layer in p.projection.image_projection_layers])
            self._joined[names] = hit
            return hit

    def _read_parts(self, name: str, folder: Path, encoder=None) -> "Parts":
        """The adapter's weights and image encoder (unless it shares `encoder`, loaded already) read on the CPU
        and checked, and the bytes they will take."""
        from transformers import CLIPImageProcessor, CLIPVisionModelWithProjection

        p = self.pipeline
        state = read_weights(weight_files(folder)[0])
        if encoder is None:
            try:
                encoder = CLIPVisionModelWithProjection.from_pretrained(folder / ENCODER, dtype=p.dtype)
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
        width = torch.empty((), dtype=p.dtype).element_size()  # the projection and IP layers take the model's dtype
        n = sum(t.numel() * width for part in state.values() for t in part.values())
        return Parts(state, encoder, features, n, sum(t.numel() * t.element_size() for t in encoder.parameters()))

    def _place(self, name: str, parts: "Parts", part: str) -> Loaded:
        """The adapter on the device: its encoder moved (a shared one is there already), its processors and
        projection built."""
        encoder = parts.encoder.to(self.pipeline.device)
        processors, projection = self._build(name, parts.state)
        return Loaded(name, processors, projection, encoder, parts.features, parts.bytes + parts.encoder_bytes, part)

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
