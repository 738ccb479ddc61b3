"""TensorRT engines of an ONNX export, sized for serving (`stepserve export tensorrt`).

Each network gets one optimization profile whose min/opt/max batch come from the serving settings (max batch size,
classifier-free guidance doubling the denoiser's and text encoder's rows, the bucket sizes a compiled server pads
to, the VAE's decodes per step) and whose latent height/width cover the sizes the model serves; see
tensorrt_profiles for the rules. Where the `tensorrt` package and a CUDA GPU exist the engines are built here with
the builder API; elsewhere the same builds are written as trtexec command lines in `build_engines.sh`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .tensorrt_plan import (
    MANIFEST_FILE,
    TENSORRT_FORMAT,
    EnginePlan,
    ExportInputError,
    write_engine_dir,
)
from .tensorrt_profiles import ENGINE_FILES

PROG = "stepserve export tensorrt"


def check_out_dir(out: Path, onnx_dir: Path) -> None:
    """--out must be new, empty, or an earlier engine folder, and not the ONNX folder itself."""
    if out.resolve() == onnx_dir.resolve():
        raise ExportInputError(f"--out {out}: is the ONNX folder; choose another folder for the engines")
    if out.exists() and not out.is_dir():
        raise ExportInputError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        manifest = out / MANIFEST_FILE
        try:
            earlier = json.loads(manifest.read_text()).get("format") if manifest.is_file() else None
        except ValueError:
            earlier = None
        if earlier != TENSORRT_FORMAT:
            raise ExportInputError(f"--out {out}: the folder exists, is not empty and is not an engine folder of "
                                   f"`{PROG}`; choose a new or empty folder")


def remove_stale_engines(plan: EnginePlan) -> list[str]:
    """Engines of an earlier run of this folder would not match the new profiles; they are removed first."""
    removed = []
    for name in ENGINE_FILES.values():
        if (plan.out / name).is_file():
            (plan.out / name).unlink()
            removed.append(name)
    return removed


def export_tensorrt(plan: EnginePlan, script_only: bool = False) -> tuple[bool, list[str]]:
    """Write the engine folder and build the engines if this machine can. Returns (built, what was missing)."""
    from .tensorrt_build import build_engine, missing_requirements, tensorrt_version

    check_out_dir(plan.out, plan.onnx.path)
    plan.out.mkdir(parents=True, exist_ok=True)
    removed = remove_stale_engines(plan)
    if removed:
        print(f"{PROG}: removed engines of an earlier run: {', '.join(removed)}", file=sys.stderr)
    missing = missing_requirements()
    write_engine_dir(plan, built=False, missing=missing)  # script and manifest first, whatever happens next
    if missing or script_only:
        return False, missing
    version = tensorrt_version()
    for profile in plan.profiles:
        lo, opt, hi = profile.batch_range
        print(f"{PROG}: building {profile.engine_file} (batch {lo}..{hi}, opt {opt}; TensorRT {version})",
              file=sys.stderr)
        build_engine(plan, profile)
    write_engine_dir(plan, built=True, missing=[], tensorrt_version=version)
    return True, []
