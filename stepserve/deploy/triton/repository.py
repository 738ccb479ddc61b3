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

from ...loading import is_export_dir
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
    strategy: str = "continuous"  # stepserve only
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


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / LAYOUT_FILE).is_file())):
        raise FileExistsError(f"--out {out}: exists and is not an empty folder or an earlier Triton repository; "
                              f"choose a new or empty folder")


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
                     quiet: bool = False) -> Path:
    """Write the repository for `model` ('embedded', a diffusers folder, or an ONNX export folder) into `out`."""
    options.check()
    out = Path(out)
    _check_out(out)
    if options.mode == "stepserve" and options.engine_backend == "torch" and is_export_dir(model):
        raise ValueError("--backend torch needs the diffusers folder (or 'embedded'), not an ONNX export")
    out.mkdir(parents=True, exist_ok=True)
    # build next to `out` and swap in at the end, so a failed export leaves no half-written repository behind
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    try:
        version = staging / ENTRY_MODEL / "1"
        version.mkdir(parents=True)
        _onnx_into(model, version / "export", options, quiet)
        if options.mode == "stepserve":
            _stepserve_layout(model, staging, options, quiet)
        else:
            _classic_layout(staging, options, quiet)
        (staging / LAYOUT_FILE).write_text(json.dumps({"model": str(model), **asdict(options)}, indent=2) + "\n")
        for old in list(out.iterdir()):
            if old != staging:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        for item in staging.iterdir():
            item.rename(out / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    models = ", ".join(sorted(p.name for p in out.iterdir() if p.is_dir()))
    _say(f"wrote the {options.mode} repository {out} (models: {models})", quiet)
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
        described = manifest["networks"][name]
        version = repo / name / "1"
        version.mkdir(parents=True)
        (export / described["file"]).rename(version / "model.onnx")  # the pipeline calls it; it needs no copy
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
