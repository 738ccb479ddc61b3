"""What `stepserve export tensorrt` will build, read from an ONNX export folder: one engine per network with its
optimization profile, the equivalent `trtexec` command line, and the engine folder's files.

The engine folder holds `<network>.plan` next to copies of the small files a pipeline needs besides its networks
(tokenizer, scheduler and network configs, serving defaults), so StableDiffusionAdapter.from_export_dir reads it
as it reads an ONNX folder. Its manifest.json has format "stepserve-tensorrt", the ONNX export's `source`, and the
profiles, commands and build status (see docs/DEPLOYMENT.md ("TensorRT engines")).
"""

from __future__ import annotations

import json
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from .tensorrt_profiles import (
    NETWORKS,
    InputSpec,
    NetworkProfile,
    ServingSettings,
    SizeRange,
    network_profiles,
)

MANIFEST_FILE = "manifest.json"
ONNX_FORMAT = "stepserve-onnx"
TENSORRT_FORMAT = "stepserve-tensorrt"
SCRIPT_FILE = "build_engines.sh"
DEFAULT_WORKSPACE_MIB = 4096
# The files of an ONNX export besides the graphs that a pipeline reads (tokenizer/ is copied whole).
PIPELINE_FILES = ("model_index.json", "stepserve.json", "scheduler/scheduler_config.json", "unet/config.json",
                  "vae/config.json", "text_encoder/config.json")
PIPELINE_DIRS = ("tokenizer",)


class ExportInputError(ValueError):
    """The ONNX folder or the options given are not usable; the message says what is wrong and what is allowed."""


@dataclass(frozen=True)
class OnnxExport:
    """What the TensorRT export reads from an ONNX folder: its manifest, each network's inputs, the served sizes."""

    path: Path
    manifest: dict
    inputs: dict[str, tuple[InputSpec, ...]]
    sizes: SizeRange


@dataclass(frozen=True)
class EnginePlan:
    """Everything to build: the profiles, the build options, and where the engines go."""

    onnx: OnnxExport
    out: Path
    settings: ServingSettings
    profiles: tuple[NetworkProfile, ...]
    fp16: bool = False
    workspace_mib: int = DEFAULT_WORKSPACE_MIB


def read_onnx_export(path: str | Path) -> OnnxExport:
    """The manifest, network inputs and size range of an ONNX export folder, with one clear error if it is not one."""
    path = Path(path)
    file = path / MANIFEST_FILE
    if not path.is_dir():
        raise ExportInputError(f"--onnx {path}: no such folder; make one with `stepserve export onnx --out {path}`")
    if not file.is_file():
        raise ExportInputError(f"--onnx {path}: no {MANIFEST_FILE}; make one with `stepserve export onnx`")
    try:
        manifest = json.loads(file.read_text())
    except ValueError as e:
        raise ExportInputError(f"--onnx {path}: {MANIFEST_FILE} is not valid JSON ({e})") from None
    if manifest.get("format") != ONNX_FORMAT:
        raise ExportInputError(f"--onnx {path}: {MANIFEST_FILE} has format {manifest.get('format')!r}, not "
                               f"{ONNX_FORMAT!r}; make an ONNX folder with `stepserve export onnx`")
    networks = manifest.get("networks") or {}
    inputs = {}
    for name in NETWORKS:
        described = networks.get(name)
        if not described or not described.get("inputs"):
            raise ExportInputError(f"--onnx {path}: {MANIFEST_FILE} describes no inputs of {name}; re-export with "
                                   f"`stepserve export onnx`")
        onnx_file = path / described.get("file", f"{name}.onnx")
        if not onnx_file.is_file():
            raise ExportInputError(f"--onnx {path}: {onnx_file.name} is missing; "
                                   f"re-export with `stepserve export onnx`")
        inputs[name] = tuple(InputSpec(i["name"], i.get("dtype", ""), tuple(i["shape"])) for i in described["inputs"])
    return OnnxExport(path, manifest, inputs, read_size_range(path))


def read_size_range(path: Path) -> SizeRange:
    """The sizes the model serves, by the same rule as serving (pipelines.diffusers_sd.model_info_for)."""
    from ..pipelines.diffusers_sd import model_info_for

    def config(rel: str) -> dict:
        file = path / rel
        if not file.is_file():
            raise ExportInputError(f"--onnx {path}: {rel} is missing; re-export with `stepserve export onnx`")
        return json.loads(file.read_text())

    unet, vae = config("unet/config.json"), config("vae/config.json")
    scheduler = config("scheduler/scheduler_config.json")
    defaults_file = path / "stepserve.json"
    defaults = json.loads(defaults_file.read_text()) if defaults_file.is_file() else {}
    try:
        info = model_info_for(path.name, SimpleNamespace(**unet), SimpleNamespace(**vae), scheduler, defaults)
    except ValueError as e:
        raise ExportInputError(f"--onnx {path}: {e}") from None
    vae_scale = 2 ** (len(vae["block_out_channels"]) - 1)
    return SizeRange(info.min_size, info.max_size, info.default_height, info.default_width, vae_scale)


def make_plan(onnx: OnnxExport, out: str | Path, settings: ServingSettings, fp16: bool = False,
              workspace_mib: int = DEFAULT_WORKSPACE_MIB) -> EnginePlan:
    if workspace_mib < 1:
        raise ExportInputError(f"--workspace-mib {workspace_mib}: must be >= 1")
    profiles = tuple(network_profiles(onnx.inputs, onnx.sizes, settings))
    return EnginePlan(onnx, Path(out), settings, profiles, fp16, workspace_mib)


# --- trtexec -----------------------------------------------------------------------------------------------------
def shape_text(shape: tuple[int, ...]) -> str:
    """trtexec writes a shape as dims joined by 'x' (1x4x64x64)."""
    return "x".join(str(d) for d in shape)


def shapes_flag(profile: NetworkProfile, which: str) -> str:
    """--minShapes/--optShapes/--maxShapes: `name:dims` for every input, comma-separated."""
    flag = {"min": "--minShapes", "opt": "--optShapes", "max": "--maxShapes"}[which]
    return flag + "=" + ",".join(f"{t.name}:{shape_text(getattr(t, which))}" for t in profile.inputs)


def trtexec_command(plan: EnginePlan, profile: NetworkProfile, onnx_dir: str | None = None,
                    out_dir: str | None = None, trtexec: str = "trtexec") -> list[str]:
    """The trtexec argv that builds the same engine as the builder API does: explicit-batch ONNX, one profile,
    the workspace pool limit, --fp16 only when asked. `onnx_dir`/`out_dir` replace the folders (the script
    passes shell variables)."""
    onnx_dir = onnx_dir if onnx_dir is not None else str(plan.onnx.path.resolve())
    out_dir = out_dir if out_dir is not None else str(plan.out.resolve())
    argv = [trtexec, f"--onnx={onnx_dir}/{profile.onnx_file}", f"--saveEngine={out_dir}/{profile.engine_file}",
            shapes_flag(profile, "min"), shapes_flag(profile, "opt"), shapes_flag(profile, "max"),
            f"--memPoolSize=workspace:{plan.workspace_mib}M"]
    if plan.fp16:
        argv.append("--fp16")
    return argv


def build_script(plan: EnginePlan) -> str:
    """A bash script that builds every engine with trtexec on a machine with TensorRT and a GPU. The folders are
    variables so the engine folder can be copied elsewhere (ONNX_DIR, OUT_DIR, TRTEXEC may be set by the caller)."""
    lines = ["#!/usr/bin/env bash",
             "# Builds the TensorRT engines of this folder with trtexec (TensorRT 10). Written by `stepserve export",
             "# tensorrt`; run it on the machine that will serve: an engine only runs on the GPU model and TensorRT",
             "# version that built it.",
             "set -euo pipefail",
             f"DEFAULT_ONNX_DIR={shlex.quote(str(plan.onnx.path.resolve()))}",
             "ONNX_DIR=\"${ONNX_DIR:-$DEFAULT_ONNX_DIR}\"",
             "OUT_DIR=\"${OUT_DIR:-$(cd \"$(dirname \"$0\")\" && pwd)}\"",
             "TRTEXEC=\"${TRTEXEC:-trtexec}\"",
             ""]
    for profile in plan.profiles:
        argv = trtexec_command(plan, profile, "@ONNX_DIR@", "@OUT_DIR@", "@TRTEXEC@")
        quoted = [shlex.quote(a).replace("@ONNX_DIR@", '"$ONNX_DIR"').replace("@OUT_DIR@", '"$OUT_DIR"')
                  .replace("@TRTEXEC@", '"$TRTEXEC"') for a in argv]
        lo, opt, hi = profile.batch_range
        lines.append("echo " + shlex.quote(f"building {profile.engine_file}: batch {lo}..{hi}, opt {opt} "
                                           f"({profile.note})"))
        lines.append(" \\\n    ".join(quoted))
        lines.append("")
    return "\n".join(lines)


# --- the engine folder -------------------------------------------------------------------------------------------
def copy_pipeline_files(onnx_dir: Path, out: Path) -> list[str]:
    """Copy what a pipeline reads besides its networks; returns the paths copied (relative)."""
    copied = []
    for rel in PIPELINE_FILES:
        if (onnx_dir / rel).is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(onnx_dir / rel, out / rel)
            copied.append(rel)
    for rel in PIPELINE_DIRS:
        if (onnx_dir / rel).is_dir():
            shutil.copytree(onnx_dir / rel, out / rel, dirs_exist_ok=True)
            copied.append(rel + "/")
    return copied


def engine_manifest(plan: EnginePlan, built: bool, missing: list[str], tensorrt_version: str | None) -> dict:
    """manifest.json of the engine folder: the ONNX export's source, the settings, each network's profile and
    command, whether the engines were built here and, if not, what was missing."""
    s = plan.settings
    onnx_manifest = plan.onnx.manifest
    return {
        "format": TENSORRT_FORMAT,
        "format_version": 1,
        "source": onnx_manifest.get("source", {}),
        "onnx": {"path": str(plan.onnx.path.resolve()), "opset": onnx_manifest.get("opset"),
                 "created": onnx_manifest.get("created"), "versions": onnx_manifest.get("versions", {})},
        "settings": {"max_batch_size": s.max_batch_size, "buckets": list(s.buckets), "opt_batch": s.resolved_opt_batch,
                     "cfg": s.cfg, "max_decode_per_step": s.max_decode_per_step, "fp16": plan.fp16,
                     "workspace_mib": plan.workspace_mib},
        "sizes": {"min_size": plan.onnx.sizes.min_size, "max_size": plan.onnx.sizes.max_size,
                  "default_height": plan.onnx.sizes.default_height, "default_width": plan.onnx.sizes.default_width,
                  "vae_scale": plan.onnx.sizes.vae_scale},
        "networks": {p.network: {
            "onnx": p.onnx_file,
            "engine": p.engine_file,
            "batch": {"min": p.batch_range[0], "opt": p.batch_range[1], "max": p.batch_range[2], "counts": p.note},
            "profiles": [{t.name: {"min": list(t.min), "opt": list(t.opt), "max": list(t.max)} for t in p.inputs}],
            "trtexec": trtexec_command(plan, p),
        } for p in plan.profiles},
        "built": built,
        "missing": missing,
        "build_script": SCRIPT_FILE,
        "tensorrt_version": tensorrt_version,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_engine_dir(plan: EnginePlan, built: bool, missing: list[str], tensorrt_version: str | None = None) -> dict:
    """Write the pipeline files, build_engines.sh (executable) and manifest.json into the engine folder."""
    plan.out.mkdir(parents=True, exist_ok=True)
    copy_pipeline_files(plan.onnx.path, plan.out)
    script = plan.out / SCRIPT_FILE
    script.write_text(build_script(plan))
    script.chmod(0o755)
    manifest = engine_manifest(plan, built, missing, tensorrt_version)
    (plan.out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
