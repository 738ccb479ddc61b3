"""Which adapter serves a diffusers folder: chosen from its model_index.json `_class_name`.

A family registers with one line in FAMILIES ("<diffusers pipeline class>": "<module>:<adapter class>"); modules
are imported only when a folder of that family is loaded. See family.py for how to write an adapter.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from ..capabilities import capabilities, missing_hooks
from .folder import resolve_model_path

FAMILIES: dict[str, str] = {
    "StableDiffusionPipeline": "stepserve.pipelines.diffusers_sd:StableDiffusionAdapter",
    "StableDiffusionInpaintPipeline": "stepserve.pipelines.diffusers_sd:StableDiffusionAdapter",
    "StableDiffusionXLPipeline": "stepserve.pipelines.sdxl:StableDiffusionXLAdapter",
    "StableDiffusionXLInpaintPipeline": "stepserve.pipelines.sdxl:StableDiffusionXLAdapter",
    "StableDiffusion3Pipeline": "stepserve.pipelines.sd3:SD3Adapter",
    "FluxPipeline": "stepserve.pipelines.flux:FluxAdapter",
    "FluxFillPipeline": "stepserve.pipelines.flux:FluxAdapter",
    "QwenImagePipeline": "stepserve.pipelines.qwenimage:QwenImageAdapter",
    "Flux2KleinPipeline": "stepserve.pipelines.flux2:Flux2Adapter",
    "Flux2Pipeline": "stepserve.pipelines.flux2_dev:Flux2DevAdapter",
    "WanPipeline": "stepserve.pipelines.wan:WanAdapter",
}

# The families the exported backends (onnxruntime, TensorRT, Triton) serve: their graphs are SD 1/2's.
EXPORT_FAMILIES = ("StableDiffusionPipeline",)


class UnsupportedModelError(ValueError):
    """The folder's pipeline class has no adapter, or not on the asked-for backend."""


def pipeline_class_name(model: str | os.PathLike) -> str:
    """The `_class_name` of the folder's model_index.json ('embedded' or a local diffusers folder)."""
    path = resolve_model_path(model)
    index = json.loads((path / "model_index.json").read_text())
    name = index.get("_class_name") if isinstance(index, dict) else None
    if not isinstance(name, str):
        raise UnsupportedModelError(f"{path / 'model_index.json'}: has no '_class_name' naming the diffusers "
                                    f"pipeline; supported: {', '.join(FAMILIES)}")
    return name


def adapter_class(class_name: str) -> type:
    """The adapter class registered for a diffusers pipeline class name."""
    target = FAMILIES.get(class_name)
    if target is None:
        raise UnsupportedModelError(f"model_index.json _class_name {class_name!r} is not supported; "
                                    f"supported: {', '.join(FAMILIES)}")
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    missing = missing_hooks(cls, capabilities(cls.family))
    if missing:  # a declaration (capabilities.py) its adapter does not keep: say so before anything loads
        raise TypeError(f"{target}: declares what it has no hooks for: {', '.join(missing)}")
    return cls


def load_family_adapter(model: str | os.PathLike, device: str = "cpu", dtype=None, weights=None):
    """Load `model` ('embedded' or a local diffusers folder) with its family's adapter on the torch backend.
    `weights` (weights.Weights): a file that replaces the folder's denoiser."""
    import torch

    from .weights import quiet_optional_imports

    cls = adapter_class(pipeline_class_name(model))
    with quiet_optional_imports():
        if weights is not None and weights.changed:
            return cls.from_pretrained(model, device=device, dtype=dtype or torch.float32, weights=weights)
        return cls.from_pretrained(model, device=device, dtype=dtype or torch.float32)


def require_export_family(model: str | os.PathLike, backend: str) -> None:
    """A clear error when a backend that runs exported SD 1/2 graphs is asked for another family."""
    name = pipeline_class_name(model)
    if name not in EXPORT_FAMILIES:
        raise UnsupportedModelError(
            f"backend {backend!r} serves {', '.join(EXPORT_FAMILIES)} folders only; {Path(str(model)).name} is a "
            f"{name} (serve it on the 'torch' backend)")
