"""`stepserve export onnx|tensorrt|triton ...`: each target has its own module with its own argparse main(argv)."""

from __future__ import annotations

import importlib
import sys

TARGETS = {
    "onnx": ("stepserve.commands.export_onnx", "text encoder, denoiser and VAE decoder as ONNX, checked against torch"),
    "tensorrt": ("stepserve.commands.export_tensorrt", "TensorRT engine plans from an ONNX export (or trtexec commands)"),
    "triton": ("stepserve.commands.export_triton", "a Triton model repository: classic (dynamic batcher) or stepserve"),
}


def usage() -> str:
    lines = ["usage: stepserve export <target> [options]", "", "targets:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in TARGETS.items()]
    lines += ["", "`stepserve export <target> --help` shows the options of a target."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in TARGETS:
        print(f"stepserve export: unknown target {name!r}; allowed: {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(TARGETS[name][0])
    return int(module.main(rest) or 0)
