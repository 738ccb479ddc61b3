"""Writes a self-contained Triton model repository: configs, the tiny model.py files, and the ONNX export (or the
diffusers folder, for the torch engine backend) copied in, so `tritonserver --model-repository REPO` needs only
stepserve installed in the Python that runs the Triton stub.

    stepserve layout                        classic layout
    REPO/pipeline/config.pbtxt (decoupled)  REPO/pipeline/config.pbtxt (dynamic batching, BLS)
    REPO/pipeline/1/model.py                REPO/pipeline/1/model.py
    REPO/pipeline/1/export/ (ONNX folder)   REPO/pipeline/1/export/ (configs, tokenizer; no .onnx)
                                            REPO/{text_encoder,unet,vae_decoder}/config.pbtxt
                                            REPO/{text_encoder,unet,vae_decoder}/1/model.onnx (+ model.py)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ...engine.loading import is_export_dir
from ...scheduling import DEFAULT_STRATEGY
from ..onnx_export import export_onnx, read_manifest
from .config import (
    ENTRY_MODEL,
    MODES,
    NETWORK_BACKENDS,
    NETWORK_MODELS,
    network_config,
    network_tensors,
    pipeline_config,
)

LAYOUT_FILE = "stepserve-triton.json"  # at the repository root: what wrote it and how (Triton ignores files there)
STAGING_PREFIX = ".staging-"
# What a rewrite of an earlier stepserve repository replaces; anything else in the folder (a .git, other models)
# is kept.
WRITTEN = (ENTRY_MODEL, *NETWORK_MODELS, LAYOUT_FILE)
ENGINE_BACKENDS = ("onnxruntime", "torch")
MODEL_PY = '''"""Written by `stepserve export triton`: the model's code is {module} in the installed stepserve."""

from {module} import TritonPythonModel  # noqa: F401
'''
MODULES = {
    "stepserve": "stepserve.server.triton.stepserve_pipeline",
    "classic": "stepserve.server.triton.classic_pipeline",
    "network": "stepserve.server.triton.network",
}


@dataclass(frozen=True)
class RepositoryOptions:
    mode: str = "stepserve"
    max_batch_size: int = 8
    max_queue_delay_ms: float = 50.0
    max_queue: int | None = None  # stepserve: the engine's queue bound; classic: Triton's max_queue_size
    strategy: str = DEFAULT_STRATEGY  # stepserve only
    engine_backend: str = "onnxruntime"  # stepserve only: how the engine runs the networks
    network_backend: str = "python"  # classic only: Python backend (runs here) or Triton's onnxruntime backend
    network_max_queue_delay_ms: float = 0.0  # classic only: the network models' dynamic batcher delay
    threads: int | None = None  # onnxruntime intra-op threads per session (None: cores - 1)
    opset: int = 17
    validate: bool = True

    def check(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode {self.mode!r} is not supported; allowed: {', '.join(MODES)}")
        if self.network_backend not in NETWORK_BACKENDS:
            raise ValueError(f"--network-backend {self.network_backend!r} is not supported; allowed: "
                             f"{', '.join(NETWORK_BACKENDS)}")
        if self.engine_backend not in ENGINE_BACKENDS:
            raise ValueError(f"--backend {self.engine_backend!r} is not supported; allowed: "
                             f"{', '.join(ENGINE_BACKENDS)}")
        if self.max_batch_size < 1:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.max_queue_delay_ms < 0 or self.network_max_queue_delay_ms < 0:
            raise ValueError("queue delays must be >= 0 ms")
        if self.max_queue is not None and self.max_queue < 1:
            raise ValueError(f"--max-queue must be >= 1, got {self.max_queue}")


def _us(ms: float) -> int:
    return round(ms * 1000)


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"stepserve export triton: {message}", flush=True)


def _write_model_py(folder: Path, module: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(MODEL_PY.format(module=module))


def _check_out(out: Path, force: bool) -> None:
    """`out` must be new, empty, or an earlier stepserve repository; with `force`, any folder."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out}: exists and is not a folder")
    foreign = out.is_dir() and not (out / LAYOUT_FILE).is_file() \
        and any(not p.name.startswith(STAGING_PREFIX) for p in out.iterdir())
    if foreign and not force:
        raise FileExistsError(f"--out {out}: exists and is not an empty folder or an earlier Triton repository; "
                              f"choose a new or empty folder, or --force to add the models to it (nothing else in "
                              f"it is touched)")


def _swap_in(staging: Path, out: Path) -> list[str]:
    """Move the staged models into `out`, replacing the entries of the same names and, in an earlier stepserve
    repository, the models it wrote; everything else in `out` stays. The layout file goes first and comes last."""
    new = sorted(p.name for p in staging.iterdir())
    replaced = set(new) | (set(WRITTEN) if (out / LAYOUT_FILE).is_file() else set())
    (out / LAYOUT_FILE).unlink(missing_ok=True)
    for old in list(out.iterdir()):
        if old != staging and (old.name in replaced or old.name.startswith(STAGING_PREFIX)):
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    for name in sorted(new, key=lambda n: n == LAYOUT_FILE):
        (staging / name).rename(out / name)
    return [name for name in new if name != LAYOUT_FILE]


def _onnx_into(model: str | os.PathLike, dest: Path, options: RepositoryOptions, quiet: bool) -> None:
    """The ONNX export of `model` in `dest`: copied when `model` is already an export, else exported now."""
    if str(model) != "embedded" and is_export_dir(model):
        _say(f"copying the ONNX export {model}", quiet)
        read_manifest(model)  # a clear error for a broken folder
        shutil.copytree(model, dest)
        return
    _say(f"exporting {model} to ONNX (checked against torch: a few seconds for the embedded model)", quiet)
    export_onnx(model, dest, opset=options.opset, validate=options.validate, show_progress=not quiet)


def write_repository(model: str | os.PathLike, out: str | os.PathLike, options: RepositoryOptions = RepositoryOptions(),
                     quiet: bool = False, force: bool = False) -> Path:
    """Write the repository for `model` ('embedded', a diffusers folder, or an ONNX export folder) into `out`:
    a new or empty folder, an earlier stepserve repository (its models are replaced, anything else kept) or, with
    `force`, any folder (the models are added; entries of the same names are replaced)."""
    options.check()
    out = Path(out)
    _check_out(out, force)
    if options.mode == "stepserve" and options.engine_backend == "torch" and is_export_dir(model):
        raise ValueError("--backend torch needs the diffusers folder (or 'embedded'), not an ONNX export")
    out.mkdir(parents=True, exist_ok=True)
    # build next to `out` and swap in at the end, so a failed export leaves no half-written repository behind
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    try:
        version = staging / ENTRY_MODEL / "1"
        version.mkdir(parents=True)
        _onnx_into(model, version / "export", options, quiet)
        if options.mode == "stepserve":
            _stepserve_layout(model, staging, options, quiet)
        else:
            _classic_layout(staging, options, quiet)
        (staging / LAYOUT_FILE).write_text(json.dumps({"model": str(model), **asdict(options)}, indent=2) + "\n")
        models = _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _say(f"wrote the {options.mode} repository {out} (models: {', '.join(models)})", quiet)
    return out


def _stepserve_layout(model: str | os.PathLike, repo: Path, options: RepositoryOptions, quiet: bool) -> None:
    version = repo / ENTRY_MODEL / "1"
    if options.engine_backend == "torch":
        from ...pipelines.diffusers_sd import resolve_model_path

        _say("copying the diffusers folder for the torch backend", quiet)
        shutil.copytree(resolve_model_path(model), version / "diffusers")
    parameters = {"strategy": options.strategy, "max_batch_size": str(options.max_batch_size),
                  "max_queue_delay_ms": f"{options.max_queue_delay_ms:g}", "backend": options.engine_backend,
                  "max_queue": "" if options.max_queue is None else str(options.max_queue),
                  "threads": "" if options.threads is None else str(options.threads)}
    (repo / ENTRY_MODEL / "config.pbtxt").write_text(
        pipeline_config("stepserve", options.max_batch_size, 0, None, parameters))  # the engine queues
    _write_model_py(version, MODULES["stepserve"])


def _classic_layout(repo: Path, options: RepositoryOptions, quiet: bool) -> None:
    export = repo / ENTRY_MODEL / "1" / "export"
    manifest = read_manifest(export)
    # classifier-free guidance doubles the UNet's rows: the networks take twice the pipeline's batch
    network_batch = 2 * options.max_batch_size
    for name in NETWORK_MODELS:
        described = manifest.get("networks", {}).get(name)
        version = repo / name / "1"
        version.mkdir(parents=True)
        _graph_file(export, name, described).rename(version / "model.onnx")  # the pipeline calls it, not this
        parameters = {} if options.threads is None else {"threads": str(options.threads)}
        if options.network_backend == "python":
            _write_model_py(version, MODULES["network"])
        (repo / name / "config.pbtxt").write_text(network_config(
            name, network_tensors(described["inputs"]), network_tensors(described["outputs"]),
            options.network_backend, network_batch, _us(options.network_max_queue_delay_ms),
            parameters if options.network_backend == "python" else {}))
    _say(f"network models: {', '.join(NETWORK_MODELS)} ({options.network_backend} backend)", quiet)
    parameters = {"network_max_batch_size": str(network_batch), "export_dir": "export"}
    (repo / ENTRY_MODEL / "config.pbtxt").write_text(
        pipeline_config("classic", options.max_batch_size, _us(options.max_queue_delay_ms), options.max_queue,
                        parameters))
    _write_model_py(repo / ENTRY_MODEL / "1", MODULES["classic"])


def _graph_file(export: Path, name: str, described) -> Path:
    """The graph file the manifest names for network `name`: a plain file name inside the export folder, never a
    path that leads out of it (a manifest is read from a folder the user gave)."""
    file = described.get("file") if isinstance(described, dict) else None
    path = export / file if isinstance(file, str) and file and Path(file).name == file else None
    if path is None or not path.resolve().is_relative_to(export.resolve()) or not path.is_file():
        raise ValueError(f"the ONNX export's manifest.json: networks.{name}.file {file!r} is not a file inside the "
                         f"export folder")
    return path
