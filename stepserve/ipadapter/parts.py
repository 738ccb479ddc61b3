"""An IP-Adapter's parts: the folder layout (one weights file and `image_encoder/` per sub-folder), its weights
split as diffusers' `load_ip_adapter` splits them, what the store holds of one, the errors, and several adapters'
attention layers joined into one processor per layer (the store's `joined`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..addons import sizes
from ..addons.errors import AddonBudgetError, AddonError, AddonTooLargeError

ENCODER = "image_encoder"
# the image encoder's weights, as transformers' from_pretrained looks for them (it prefers safetensors)
ENCODER_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


class IPAdapterError(AddonError):
    """An IP-Adapter that cannot be named, loaded or served; the message says which and why (HTTP 400)."""

    default_param = "ip_adapter"


class IPAdapterBudgetError(IPAdapterError, AddonBudgetError):
    """The adapter does not fit the IP-Adapter memory beside the adapters that requests in flight use: retry later
    (HTTP 429)."""


class IPAdapterTooLargeError(IPAdapterError, AddonTooLargeError):
    """Larger than the whole IP-Adapter memory (--ip-adapter-memory-mb), alone or with the others of its request:
    it can never be loaded (HTTP 400)."""


def weight_files(folder: Path) -> list[Path]:
    """The adapter's weights file(s): suffixes as diffusers' load_ip_adapter dispatches on them (case matters)."""
    return sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in (".safetensors", ".bin"))


def encoder_weights(folder: Path) -> Path | None:
    return next((folder / ENCODER / f for f in ENCODER_WEIGHTS if (folder / ENCODER / f).is_file()), None)


def files_of(folder: Path) -> list[Path]:
    """Every file whose change makes another adapter of the folder (what a remembered size is valid for)."""
    return [*weight_files(folder)[:1], *filter(None, [encoder_weights(folder)])]


def sizes_of(folder: Path, width: int) -> tuple[int, int]:
    """The bytes an adapter will take loaded in a dtype `width` bytes wide, read from its files' headers before
    anything is loaded: its own (image projection and IP layers) and its image encoder's."""
    weights = weight_files(folder)[0]
    own = sizes.file_bytes(weights, width, keep=lambda key: key.split(".", 1)[0] in ("image_proj", "ip_adapter"))
    encoder = encoder_weights(folder)
    return own, (sizes.file_bytes(encoder, width) if encoder is not None else 0)


_digests: dict[tuple, str] = {}  # (file, size, mtime) -> the digest of its bytes


def encoder_part(folder: Path) -> str:
    """The name of the adapter's image encoder in the store: the same for every adapter whose image encoder has
    the same config and weights (a copy or a link of one), so that they share one copy of it loaded, as
    diffusers' pipeline keeps one image encoder for all its IP-Adapters. Its files are hashed once per change."""
    files = [folder / ENCODER / "config.json", *filter(None, [encoder_weights(folder)])]
    digest = hashlib.sha256()
    for f in files:
        s = f.stat()
        key = (str(f.resolve()), s.st_size, s.st_mtime_ns)
        if key not in _digests:
            with open(f, "rb") as fh:
                _digests[key] = hashlib.file_digest(fh, "sha256").hexdigest()
        digest.update(_digests[key].encode())
    return f"{ENCODER}@{digest.hexdigest()[:12]}"


def discover(root: Path | None) -> dict[str, Path]:
    """The folder's IP-Adapters by name: sub-folders with one weights file and an image_encoder/ config."""
    if root is None or not root.is_dir():
        return {}
    return {d.name: d for d in sorted(root.iterdir())
            if d.is_dir() and (d / ENCODER / "config.json").is_file() and len(weight_files(d)) == 1}


@dataclass
class Parts:
    """An adapter read and checked on the CPU, not yet on the device."""

    state: dict  # {"image_proj": ..., "ip_adapter": ...} as load_ip_adapter splits the weights
    encoder: torch.nn.Module  # read for it, or the one already loaded that it shares
    features: object
    bytes: int  # what it will take loaded beside its encoder (projection and IP layers)
    encoder_bytes: int


@dataclass
class Loaded:
    name: str
    processors: dict  # the UNet's attention processors with this adapter (IP processors on the cross-attentions)
    projection: torch.nn.Module  # diffusers' MultiIPAdapterImageProjection (the UNet's encoder_hid_proj)
    encoder: torch.nn.Module  # CLIPVisionModelWithProjection
    features: object  # CLIPImageProcessor: a picture -> the encoder's pixel values
    bytes: int  # its layers and its image encoder (which other adapters may share)
    part: str = ""  # its image encoder's name in the store (parts.encoder_part)


def joined_processor(processors: list) -> object:
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


def read_weights(file: Path) -> dict:
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
