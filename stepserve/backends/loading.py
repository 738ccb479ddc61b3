"""Builds a pipeline adapter for a backend: torch runs the diffusers folder itself; onnxruntime runs an ONNX export
of it (made once and cached when given a diffusers folder); tensorrt runs engine plans built from such an export."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ONNX_CACHE_ENV = "STEPSERVE_CACHE"


def onnx_cache_dir(source: Path) -> Path:
    """Where the ONNX export of a diffusers folder is kept: keyed by the folder, its files' sizes and times, and
    the versions that shape the export, so a changed model or library makes a new export."""
    from importlib.metadata import version

    root = Path(os.environ.get(ONNX_CACHE_ENV) or Path.home() / ".cache" / "stepserve") / "onnx"
    key = hashlib.sha256(str(source.resolve()).encode())
    for file in sorted(source.rglob("*")):
        if file.is_file():
            stat = file.stat()
            key.update(f"{file.relative_to(source)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    for package in ("stepserve", "torch", "onnx"):
        key.update(version(package).encode())
    return root / f"{source.name}-{key.hexdigest()[:16]}"


def onnx_folder(model: str | os.PathLike) -> Path:
    """An ONNX export folder for `model`: itself if it is one, else the cached export of the diffusers folder
    (exported and checked against torch on first use)."""
    from ..deploy.onnx_export import export_onnx, is_export_dir
    from ..pipelines.diffusers_sd import resolve_model_path
    from ..pipelines.registry import require_export_family

    if str(model) != "embedded" and is_export_dir(model):
        return Path(model)
    source = resolve_model_path(model)
    require_export_family(model, "onnxruntime")
    cached = onnx_cache_dir(source)
    if not is_export_dir(cached):
        log.warning("exporting %s to ONNX in %s (once; reused while the model is unchanged)", model, cached)
        partial = cached.with_name(cached.name + f".partial-{os.getpid()}")
        export_onnx(model, partial)
        partial.rename(cached)
    return cached


def load_adapter(model: str | os.PathLike, backend: str, device: str, dtype: str, threads: int | None = None):
    import torch

    from ..pipelines.diffusers_sd import StableDiffusionAdapter
    from ..pipelines.registry import load_family_adapter
    from . import BACKENDS

    if backend == "torch":  # the folder's model_index.json _class_name picks the family adapter
        return load_family_adapter(model, device=device, dtype=getattr(torch, dtype))
    if backend == "onnxruntime":
        if device != "cpu" or dtype != "float32":
            raise ValueError(f"backend 'onnxruntime' runs on the CPU in float32; got --device {device} "
                             f"--dtype {dtype} (use --backend torch or tensorrt for a GPU)")
        return StableDiffusionAdapter.from_onnx_dir(onnx_folder(model), threads=threads)
    if backend == "tensorrt":
        from .tensorrt import load_tensorrt_networks

        if not str(device).startswith("cuda"):
            raise ValueError(f"backend 'tensorrt' needs --device cuda; got --device {device}")
        networks = load_tensorrt_networks(Path(model), device)
        return StableDiffusionAdapter.from_export_dir(model, networks, "tensorrt", device)
    raise ValueError(f"backend: {backend!r} is not supported; allowed: {', '.join(BACKENDS)}")
