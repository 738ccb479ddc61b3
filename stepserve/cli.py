"""`stepserve <command> ...`: each command lives in its own module with its own argparse `main(argv)`."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "serve": ("stepserve.commands.serve", "serve the OpenAI-compatible images API over HTTP"),
    "demo": ("stepserve.commands.demo", "generate images on the embedded model under each strategy and compare"),
    "bench": ("stepserve.commands.bench", "load-test strategies or a running server; write a report"),
    "simulate": ("stepserve.commands.simulate", "replay a bench workload on a simulated clock with a latency model"),
    "plan": ("stepserve.commands.plan", "the fewest replicas behind a router that hold a p95 SLO at a rate (simulated)"),
    "export": ("stepserve.commands.export", "export to ONNX, TensorRT plans or a Triton model repository"),
    "profile": ("stepserve.commands.profile", "measure a model's stage latencies on this device; write a latency model"),
    "tiny": ("stepserve.commands.tiny", "write a tiny diffusers folder with random weights (no download) to try a family"),
    "grid": ("stepserve.commands.grid", "write a sample grid (every digit x several seeds) of the embedded model"),
    "train-embedded": ("stepserve.commands.train_embedded", "retrain the embedded default model from scikit-learn digits"),
}


def usage() -> str:
    lines = ["usage: stepserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<15} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "`stepserve <command> --help` shows the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"stepserve {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"stepserve: unknown command {name!r}; allowed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
