"""`stepserve export onnx`: the text encoder, denoiser and VAE decoder of a pipeline as ONNX graphs with a dynamic
batch axis (and per-row timesteps), plus everything else a server needs to run them without the torch weights:
tokenizer, scheduler and network configs, serving defaults, and a manifest. An export is written beside the
folder's contents and swapped in when it is complete: a failed (re-)export leaves the folder as it was.

Every export is checked before it is declared done: onnxruntime against torch at batch 1, 3 and 8, with a
different timestep on every row; the largest difference of each network is written to the manifest.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from ..pipelines.diffusers_sd import (
    SERVING_DEFAULTS_FILE,
    StableDiffusionAdapter,
    resolve_model_path,
)
from ..pipelines.registry import require_export_family
from ..util.progress import progress
from .onnx_networks import GraphSpec, example_inputs, graph_module, graph_specs

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "stepserve-onnx"
STAGING_PREFIX = ".staging-"
DEFAULT_OPSET = 17
OPSETS = range(14, 21)  # what the TorchScript-based exporter writes for these networks
VALIDATION_BATCHES = (1, 3, 8)
# Largest allowed |onnxruntime - torch| per network, in float32: the denoiser's and text encoder's outputs are
# compared as they are; the decoder's are images in [-1, 1], where a uint8 level is 2/255.
TOLERANCE = {"text_encoder": 1e-4, "unet": 1e-4, "vae_decoder": 1e-3}
COPIED = ("model_index.json", SERVING_DEFAULTS_FILE, "scheduler/scheduler_config.json", "unet/config.json",
          "vae/config.json", "text_encoder/config.json")


class ExportError(RuntimeError):
    """The export could not be made or did not match torch."""


def export_onnx(model: str | os.PathLike = "embedded", out: str | os.PathLike = "onnx", opset: int = DEFAULT_OPSET,
                validate: bool = True, show_progress: bool = True) -> Path:
    """Export `model` ('embedded' or a diffusers folder) into the folder `out`; returns it."""
    if opset not in OPSETS:
        raise ValueError(f"opset: {opset} is not supported; allowed: {OPSETS.start}..{OPSETS.stop - 1}")
    source = resolve_model_path(model)
    require_export_family(model, "onnx export")
    out = Path(out)
    # empty, or holding only the staging folder of a killed export
    empty = out.is_dir() and all(p.name.startswith(STAGING_PREFIX) for p in out.iterdir())
    if out.exists() and not empty and not (out / MANIFEST_FILE).is_file():
        raise ExportError(f"--out {out}: the folder exists, is not empty and is not an ONNX export; "
                          f"choose a new or empty folder")
    adapter = StableDiffusionAdapter.from_pretrained(source)
    out.mkdir(parents=True, exist_ok=True)
    # written into a staging folder and swapped in at the end: a failed (re-)export leaves the folder as it was
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    try:
        _export_into(adapter, model, source, staging, opset, validate, show_progress)
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _export_into(adapter, model, source: Path, out: Path, opset: int, validate: bool, show_progress: bool) -> None:
    specs = graph_specs(adapter.use_attention_mask)
    # one step: exporting one graph, or checking one against torch
    work = f"export{' and check' if validate else ''} {len(specs)} graphs"
    bar = progress(len(specs) * (2 if validate else 1), f"export onnx ({work})", "step", disable=not show_progress)
    generator = torch.Generator().manual_seed(0)
    networks, validation = {}, {}
    with bar:
        for spec in specs:
            bar.set_postfix_str(f"export {spec.name}")
            _export_graph(adapter, spec, out, opset, generator)
            networks[spec.name] = _describe(out / spec.file)
            bar.update(1)
        if validate:
            for spec in specs:
                bar.set_postfix_str(f"check {spec.name}")
                validation[spec.name] = _validate(adapter, spec, out, generator)
                bar.update(1)
    _copy_pipeline_files(source, out, adapter)
    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": 1,
        "opset": opset,
        "source": {"model": str(model), "name": adapter.info.name, "path": str(source)},
        "networks": networks,
        "validation": validation,
        "versions": _versions(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def _swap_in(staging: Path, out: Path) -> None:
    """Replace the contents of `out` by those of `staging` (inside it). The old manifest goes first and the new
    one comes last, so at no moment does a manifest describe graphs it did not check."""
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    for old in list(out.iterdir()):
        if old != staging:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    for item in sorted(staging.iterdir(), key=lambda p: p.name == MANIFEST_FILE):
        item.rename(out / item.name)


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of an export folder, with a clear error when the folder is not one."""
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no {MANIFEST_FILE}; an ONNX folder is made by "
                                f"`stepserve export onnx --model M --out DIR`")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{file}: format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}")
    return manifest


def _export_graph(adapter, spec: GraphSpec, out: Path, opset: int, generator: torch.Generator) -> None:
    module = graph_module(adapter, spec)
    args = example_inputs(adapter, spec, 2, generator)  # batch 2: an example of 1 can get folded into the graph
    try:
        with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # tracer warnings about Python control flow on shapes
            torch.onnx.export(module, args, str(out / spec.file), input_names=list(spec.inputs),
                              output_names=list(spec.outputs), dynamic_axes=spec.dynamic_axes,
                              opset_version=opset, dynamo=False, do_constant_folding=True)
    except ModuleNotFoundError as e:
        raise ExportError(f"exporting {spec.name} needs the `onnx` package: pip install 'stepserve[onnx]' ({e})")
    except Exception as e:  # the exporter's own errors are many types; say which network and opset failed
        raise ExportError(f"ONNX export of {spec.name} failed at opset {opset}: {type(e).__name__}: {e}") from e


def _describe(file: Path) -> dict:
    """Inputs and outputs of a saved graph as the graph states them (symbolic names for dynamic axes)."""
    import onnx

    graph = onnx.load(str(file), load_external_data=False).graph

    def io(values) -> list[dict]:
        return [{"name": v.name, "dtype": onnx.TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower(),
                 "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]

    return {"file": file.name, "bytes": file.stat().st_size, "inputs": io(graph.input), "outputs": io(graph.output)}


def _validate(adapter, spec: GraphSpec, out: Path, generator: torch.Generator) -> dict[str, float]:
    """onnxruntime against torch at each validation batch; raises ExportError past the tolerance."""
    from ..backends.onnxruntime import make_session

    session = make_session(out / spec.file)
    module = graph_module(adapter, spec)
    diffs = {}
    for batch in VALIDATION_BATCHES:
        args = example_inputs(adapter, spec, batch, generator)
        with torch.no_grad():
            want = module(*args)
        got = session.run(None, {name: a.numpy() for name, a in zip(spec.inputs, args)})[0]
        diff = float((torch.from_numpy(got) - want).abs().max())
        diffs[str(batch)] = diff
        if not diff <= TOLERANCE[spec.name]:
            raise ExportError(f"{spec.name}: onnxruntime differs from torch by {diff:.3g} at batch {batch} "
                              f"(allowed {TOLERANCE[spec.name]:g})")
    return diffs


def _copy_pipeline_files(source: Path, out: Path, adapter) -> None:
    for rel in COPIED:
        if (source / rel).is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / rel, out / rel)
    adapter.tokenizer.save_pretrained(out / "tokenizer")


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("stepserve", "torch", "diffusers", "transformers", "onnx", "onnxruntime"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found
