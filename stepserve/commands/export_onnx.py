"""`stepserve export onnx --model embedded|PATH --out DIR [--opset N] [--no-validate]`."""

from __future__ import annotations

import argparse
import sys
import time

from .flags import DefaultsHelpFormatter


def build_parser() -> argparse.ArgumentParser:
    from ..deploy.onnx_export import (  # imports torch: after main's clock has started
        DEFAULT_OPSET,
        OPSETS,
    )

    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, prog="stepserve export onnx",
                                description="Export the text encoder, denoiser and VAE decoder to ONNX with a "
                                            "dynamic batch axis and per-row timesteps, checked against torch.")
    p.add_argument("--model", default="embedded", help="'embedded' or a local diffusers folder (model_index.json)")
    p.add_argument("--out", required=True, help="the folder to write (new or empty, or an earlier export)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET,
                   help=f"ONNX opset, {OPSETS.start}..{OPSETS.stop - 1} (default {DEFAULT_OPSET})")
    p.add_argument("--no-validate", action="store_true",
                   help="skip the onnxruntime-vs-torch check at batch 1, 3 and 8")
    return p


def main(argv: list[str]) -> int:
    started = time.monotonic()  # the command's time covers importing torch and loading the model too
    args = build_parser().parse_args(argv)
    from ..deploy.onnx_export import ExportError, export_onnx

    try:
        out = export_onnx(args.model, args.out, args.opset, validate=not args.no_validate)
    except (OSError, ValueError, ExportError) as e:
        print(f"stepserve export onnx: error: {e}", file=sys.stderr)
        return 2
    print(f"stepserve export onnx: wrote {out} {time.monotonic() - started:.1f} s after the command started "
          f"(loading torch and the model, exporting, checking; manifest.json lists the graphs, their shapes and the "
          f"check)")
    return 0
