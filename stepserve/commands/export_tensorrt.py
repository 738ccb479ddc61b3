"""`stepserve export tensorrt --onnx DIR --out DIR`: TensorRT engines of an ONNX export, sized for serving.

Each network gets one optimization profile whose min/opt/max batch come from the serving settings (max batch size,
classifier-free guidance doubling the denoiser's and text encoder's rows, the bucket sizes a compiled server pads
to, the VAE's decodes per step) and whose latent height/width cover the sizes the model serves; see
tensorrt_profiles for the rules. Where the `tensorrt` package and a CUDA GPU exist the engines are built here with
the builder API; elsewhere the same builds are written as trtexec command lines in `build_engines.sh`, and stderr
says what was missing.

Exit status: 0 when the engines were built, or when they could not be built here and the script was written
(`--require-build` turns the latter into 3); 1 when TensorRT failed to build an engine; 2 for bad options or an
unusable ONNX folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..deploy.tensorrt import PROG, export_tensorrt
from ..deploy.tensorrt_plan import (DEFAULT_WORKSPACE_MIB, MANIFEST_FILE, SCRIPT_FILE, ExportInputError, make_plan,
                                    read_onnx_export)
from ..deploy.tensorrt_profiles import ServingSettings
from .flags import DefaultsHelpFormatter

EXIT_NOT_BUILT = 3  # only with --require-build


def parse_buckets(text: str) -> tuple[int, ...]:
    try:
        buckets = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of batch sizes, e.g. 1,2,4,8")
    if not buckets or min(buckets) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every bucket must be an integer >= 1, e.g. 1,2,4,8")
    return buckets


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter, prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog=f"Exit status: 0 built, or not buildable here and build_engines.sh "
                                       f"written; {EXIT_NOT_BUILT} the latter with --require-build; 1 TensorRT "
                                       "failed; 2 bad options or ONNX folder. Rules for min/opt/max and the engine "
                                       "folder: docs/DEPLOYMENT.md (TensorRT engines).")
    p.add_argument("--onnx", required=True, type=Path, metavar="DIR",
                   help="an ONNX folder made by `stepserve export onnx`")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="the engine folder to write")
    p.add_argument("--max-batch-size", type=int, default=8, metavar="N", help="the server's max_batch_size (default 8)")
    p.add_argument("--buckets", type=parse_buckets, default=(), metavar="N,N,...",
                   help="batch sizes a compiled server pads batches to, e.g. 1,2,4,8 (default: none)")
    p.add_argument("--opt-batch", type=int, default=None, metavar="N",
                   help="the batch (in requests) to tune for; default: the bucket a full batch pads to, else "
                        "--max-batch-size")
    p.add_argument("--max-decode-per-step", type=int, default=None, metavar="N",
                   help="the engine's cap on VAE decodes per step (default: a whole batch)")
    p.add_argument("--no-cfg", action="store_true",
                   help="no request uses guidance_scale > 1, so batches are not doubled for guidance")
    p.add_argument("--fp16", action="store_true", help="let TensorRT use FP16 kernels (inputs/outputs stay FP32)")
    p.add_argument("--workspace-mib", type=int, default=DEFAULT_WORKSPACE_MIB, metavar="N",
                   help=f"TensorRT's workspace memory pool limit in MiB (default {DEFAULT_WORKSPACE_MIB})")
    p.add_argument("--script-only", action="store_true",
                   help="write build_engines.sh and manifest.json without building, even where TensorRT exists")
    p.add_argument("--require-build", action="store_true",
                   help=f"exit {EXIT_NOT_BUILT} (not 0) when the engines could not be built here")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = ServingSettings(max_batch_size=args.max_batch_size, buckets=args.buckets,
                                   opt_batch=args.opt_batch, cfg=not args.no_cfg,
                                   max_decode_per_step=args.max_decode_per_step)
        onnx = read_onnx_export(args.onnx)
        plan = make_plan(onnx, args.out, settings, fp16=args.fp16, workspace_mib=args.workspace_mib)
        built, missing = export_tensorrt(plan, script_only=args.script_only)
    except (ExportInputError, ValueError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # EngineBuildError, or TensorRT's own errors
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if built:
        print(f"built {len(plan.profiles)} engines into {plan.out} (profiles in {plan.out / MANIFEST_FILE})")
        return 0
    if args.script_only:
        print(f"{PROG}: engines not built (--script-only); wrote the trtexec commands to {plan.out / SCRIPT_FILE}",
              file=sys.stderr)
    else:
        print(f"{PROG}: cannot build TensorRT engines here: missing {' and '.join(missing)}. Wrote the equivalent "
              f"trtexec commands to {plan.out / SCRIPT_FILE} and the profiles to {plan.out / MANIFEST_FILE}; run "
              f"the script on the machine that will serve (TensorRT 10 and its GPU).", file=sys.stderr)
    return EXIT_NOT_BUILT if args.require_build else 0
