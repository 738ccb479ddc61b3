"""The ONNX export of a diffusers folder, made once and kept in a cache: what `--backend onnxruntime` serves when
a command is given a diffusers folder instead of an export folder. Commands resolve the model argument with
`onnx_folder` before they build an engine; the engine side only ever loads export folders (stepserve.engine.loading)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..engine.loading import is_export_dir
from ..pipelines.diffusers_sd import resolve_model_path
from ..pipelines.registry import require_export_family
from ..util.extras import require_extra
from .onnx_export import export_onnx

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
    (exported and checked against torch on first use). Processes that ask at once (replicas) take turns on a lock
    file of the entry: one exports, the others reuse its export. A failed export leaves nothing behind."""
    if is_export_dir(model):
        return Path(model)
    source = resolve_model_path(model)
    require_export_family(model, "onnxruntime")
    cached = onnx_cache_dir(source)
    if is_export_dir(cached):
        return cached
    locks = cached.parent.parent / ".locks" / "onnx"  # outside the entries, as the Hugging Face cache keeps them
    locks.mkdir(parents=True, exist_ok=True)
    with _locked(locks / f"{cached.name}.lock"):
        if is_export_dir(cached):  # another process exported it while this one waited
            return cached
        for stale in cached.parent.glob(f"{cached.name}.partial-*"):  # of a killed export: the lock was free
            shutil.rmtree(stale, ignore_errors=True)
        log.warning("exporting %s to ONNX in %s (once; reused while the model is unchanged)", model, cached)
        partial = cached.with_name(cached.name + f".partial-{os.getpid()}")
        try:
            export_onnx(model, partial)
            if cached.exists():  # an empty or broken entry (not an export): replaced
                shutil.rmtree(cached)
            partial.rename(cached)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return cached


@contextlib.contextmanager
def _locked(lock_file: Path) -> Iterator[None]:
    """An exclusive lock on `lock_file` (flock: released when the process ends, however it ends)."""
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("waiting for another process exporting to ONNX (%s)", lock_file)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def serving_model(model: str, backend: str) -> str:
    """The model argument a command hands to the engine builder: on onnxruntime, a diffusers folder (or
    'embedded') becomes its cached export; anything else is passed on as given. On onnxruntime without the onnx
    extra: MissingExtraError (a ValueError), before anything is exported or loaded."""
    if backend != "onnxruntime":
        return model
    if is_export_dir(model):
        require_extra("onnx", "--backend onnxruntime", "onnxruntime")
        return model
    require_extra("onnx", "--backend onnxruntime", "onnxruntime", "onnx")  # runs the networks; exports them first
    return str(onnx_folder(model))
