"""A local diffusers pipeline folder as the family adapters load it: where it is ('embedded' or a path), its
model_index.json, scheduler config and stepserve.json serving defaults, and its sub-folders' components loaded
with their classes' `from_pretrained(local_files_only=True)`. Nothing is downloaded: paths are made absolute (a
relative `sd15/tokenizer` would otherwise be tried as a Hub repo id) and a missing component is an error naming
it. Also the ModelInfo that a family's own defaults and
the folder's stepserve.json make together (serving_info).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..request.types import ModelInfo
from .weights import (
    Weights,
    check_checkpoint,
    check_denoiser_file,
    load_checkpoint,
    load_denoiser,
    quantization_config,
)

SERVING_DEFAULTS_FILE = "stepserve.json"
EMBEDDED_PATH = Path(__file__).resolve().parent.parent / "models" / "embedded"


def resolve_model_path(model: str | os.PathLike) -> Path:
    """'embedded' -> the model that ships with stepserve; otherwise a local diffusers folder, as an absolute path
    (symbolic links kept, so the folder's name stays the name given)."""
    path = EMBEDDED_PATH if str(model) == "embedded" else Path(os.path.abspath(Path(model).expanduser()))
    if not (path / "model_index.json").is_file():
        if str(model) == "embedded":
            raise FileNotFoundError(f"the embedded model is missing from the installation ({path})")
        raise FileNotFoundError(
            f"model: {str(model)!r} is neither 'embedded' nor a local diffusers folder with model_index.json"
        )
    return path


def model_name(model: str | os.PathLike, path: Path) -> str:
    return "embedded" if str(model) == "embedded" else path.name


def serving_defaults(path: Path) -> dict:
    """The folder's stepserve.json (serving defaults and allowed sizes), or {}."""
    defaults_file = path / SERVING_DEFAULTS_FILE
    return json.loads(defaults_file.read_text()) if defaults_file.is_file() else {}


def read_scheduler_config(path: Path) -> dict:
    """The folder's scheduler/scheduler_config.json as a dict."""
    return json.loads((path / "scheduler" / "scheduler_config.json").read_text())


@dataclass(frozen=True)
class PipelineFolder:
    """An opened pipeline folder: `path`, `name` (ModelInfo.name: 'embedded' or the folder's name), `index`
    (model_index.json) and `weights` (a file that replaces the folder's denoiser, weights.py). The scheduler config
    and serving defaults are read when asked for."""

    path: Path
    name: str
    index: dict
    weights: Weights = Weights()

    @classmethod
    def open(cls, model: str | os.PathLike, pipeline_class: str | tuple[str, ...] | None = None,
             weights: Weights | None = None) -> "PipelineFolder":
        """`model`: 'embedded' or a local diffusers folder; with `pipeline_class` (one name or several), its
        model_index.json must name that diffusers pipeline. `weights`: where the denoiser's come from, if not
        from the folder."""
        path = resolve_model_path(model)
        index = json.loads((path / "model_index.json").read_text())
        allowed = (pipeline_class,) if isinstance(pipeline_class, str) else pipeline_class
        if allowed is not None and index.get("_class_name") not in allowed:
            raise ValueError(f"model: {path} holds a {index.get('_class_name')!r}, not a {' or '.join(allowed)}")
        weights = weights or Weights()
        check_denoiser_file(weights, tuple(k for k in index if not k.startswith("_")))
        check_checkpoint(weights, index.get("_class_name"))
        name = Path(weights.checkpoint).stem if weights.checkpoint else model_name(model, path)
        return cls(path, name, index, weights)

    def scheduler_config(self) -> dict:
        return read_scheduler_config(self.path)

    def serving_defaults(self) -> dict:
        return serving_defaults(self.path)

    def load(self, dtype: torch.dtype | None = None, **parts: type) -> list[Any]:
        """The components `name=Class` in the order given, each loaded from the sub-folder `name` with
        `Class.from_pretrained`. Networks (torch modules) load in `dtype` when it is given, else as diffusers and
        transformers load them by default; tokenizers take no dtype."""
        loaded = []
        with loading_bars_only_on_a_terminal():
            for name, part_class in parts.items():
                options = {}
                if self.weights.checkpoint is not None:
                    loaded.append(self._from_checkpoint(name, part_class, dtype))
                    continue
                if self.weights.replaces(name):
                    loaded.append(load_denoiser(part_class, self.path / name, self.weights, dtype))
                    continue
                if dtype is not None and issubclass(part_class, torch.nn.Module):
                    options["torch_dtype"] = dtype
                if self.weights.quantizes(name):
                    options["quantization_config"] = quantization_config(self.weights, dtype, part_class)
                loaded.append(load_local(part_class, self.path / name, **options))
        return loaded


    def _from_checkpoint(self, name: str, part_class: type, dtype: torch.dtype | None) -> Any:
        """Part `name` of the whole-model file (read once), in `dtype` when it is a network."""
        pipe = self.__dict__.get("_checkpoint")
        if pipe is None:
            pipe = self.__dict__["_checkpoint"] = load_checkpoint(self.weights, self.path, self.index["_class_name"])
        part = getattr(pipe, name, None)
        if part is None:
            raise ValueError(f"model: {self.weights.checkpoint} gave no {name} ({part_class.__name__})")
        if dtype is not None and isinstance(part, torch.nn.Module):
            part = part.to(dtype)
        return part


def load_local(part_class: type, folder: Path, **options) -> Any:
    """`part_class.from_pretrained(folder)` from the local `folder` only (absolute, local_files_only): never a
    Hub look-up. A missing folder, or a file missing in it, is a FileNotFoundError naming it."""
    folder = Path(os.path.abspath(folder))
    if not folder.is_dir():
        raise FileNotFoundError(f"model: {folder} is missing (a component of the diffusers folder {folder.parent})")
    try:
        return part_class.from_pretrained(folder, local_files_only=True, **options)
    except OSError as e:  # transformers and diffusers: "does not appear to have a file named ..."
        raise FileNotFoundError(f"model: {folder}: {part_class.__name__} cannot load it: {e}") from e


def serving_info(name: str, defaults: dict, *, size_multiple: int, default_size: int, min_size: int, max_size: int,
                 default_sampler: str, default_steps: int, default_guidance_scale: float, samplers: tuple[str, ...],
                 size_limit: int | None = None, **family_rules) -> ModelInfo:
    """A family's ModelInfo: its own defaults (the pipeline's default size, sampler, steps and guidance; the sizes
    it serves, min_size to max_size in steps of size_multiple), each overridden by the folder's stepserve.json
    (`defaults`: height, width, min_size, max_size, default_sampler, default_steps, default_guidance_scale) and
    checked. `size_limit`: a bound max_size may not pass (what the network takes); `family_rules`: ModelInfo's
    family, negative_prompt and guidance (what a request may set)."""
    height = int(defaults.get("height", default_size))
    width = int(defaults.get("width", default_size))
    min_size = int(defaults.get("min_size", min_size))
    max_size = int(defaults.get("max_size", max_size))
    over_limit = size_limit is not None and max_size > size_limit
    if min_size % size_multiple or max_size % size_multiple or over_limit \
            or not min_size <= min(height, width) <= max(height, width) <= max_size:
        at_most = f", at most {size_limit}," if size_limit is not None else ""
        raise ValueError(f"{SERVING_DEFAULTS_FILE}: min_size {min_size} and max_size {max_size} must be multiples "
                         f"of {size_multiple}{at_most} around the default size {width}x{height}")
    return ModelInfo(name=name, default_sampler=defaults.get("default_sampler", default_sampler),
                     default_steps=int(defaults.get("default_steps", default_steps)),
                     default_guidance_scale=float(defaults.get("default_guidance_scale", default_guidance_scale)),
                     default_height=height, default_width=width, size_multiple=size_multiple, min_size=min_size,
                     max_size=max_size, samplers=samplers, **family_rules)


@contextlib.contextmanager
def loading_bars_only_on_a_terminal() -> Iterator[None]:
    """transformers and diffusers draw their own weight-loading bars; in a log (stderr not a terminal) those are
    carriage-return noise, so they are turned off while loading and restored after."""
    if sys.stderr.isatty():
        yield
        return
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    states = [(m, m.is_progress_bar_enabled()) for m in (diffusers_logging, transformers_logging)]
    for m, _ in states:
        m.disable_progress_bar()
    try:
        yield
    finally:
        for m, enabled in states:
            if enabled:
                m.enable_progress_bar()
