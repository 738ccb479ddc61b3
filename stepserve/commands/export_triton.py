"""`stepserve export triton --model embedded|PATH --out REPO [--mode stepserve|classic] ...`.

Options that belong to one mode are refused with the other, so a command never silently ignores a flag.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ..scheduling import DEFAULT_MAX_QUEUE_DELAY_MS, DEFAULT_STRATEGY, STRATEGIES
from ..deploy.onnx_export import ExportError
from ..deploy.triton.config import MODES, NETWORK_BACKENDS
from ..deploy.triton.repository import ENGINE_BACKENDS, RepositoryOptions, write_repository
from .flags import DefaultsHelpFormatter

PROG = "stepserve export triton"
STEPSERVE_ONLY = ("strategy", "backend")
CLASSIC_ONLY = ("network_backend", "network_max_queue_delay_ms")


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        formatter_class=DefaultsHelpFormatter, prog=PROG,
        description="Write a self-contained Triton model repository whose entry model `pipeline` serves the model. "
                    "stepserve: one decoupled model running stepserve's engine (requests join the batch at any "
                    "denoising step; gRPC streaming). classic: Triton's dynamic batcher plus a BLS model over "
                    "text_encoder, unet and vae_decoder models (whole requests batched, the baseline).")
    p.add_argument("--model", default="embedded",
                   help="'embedded', a local diffusers folder (model_index.json) or a `stepserve export onnx` folder")
    p.add_argument("--out", required=True, help="the repository folder to write (new, empty, or an earlier one: its "
                                                "stepserve models are replaced, anything else in it is kept)")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty folder that is not a stepserve repository (e.g. one holding other "
                        "Triton models): the models are added, entries of the same names replaced, the rest kept")
    p.add_argument("--mode", default="stepserve", choices=MODES,
                   help="stepserve: the engine in one decoupled model; classic: Triton's dynamic batcher over "
                        "ONNX network models and a BLS pipeline")
    p.add_argument("--max-batch-size", type=_int_at_least(1), default=8,
                   help="images per batch (the entry model's max_batch_size; the engine's batch bound)")
    p.add_argument("--max-queue-delay-ms", type=_non_negative, default=DEFAULT_MAX_QUEUE_DELAY_MS,
                   help="classic: Triton's dynamic batcher delay; stepserve: the engine's (dynamic strategy)")
    p.add_argument("--max-queue", type=_int_at_least(1), default=None,
                   help="requests waiting at most; beyond it a request is refused (stepserve: 'queue full ...'; "
                        "classic: Triton's 'Exceeds maximum queue size'). Default: unbounded")
    p.add_argument("--threads", type=_int_at_least(1), default=None,
                   help="onnxruntime intra-op threads per network session (default: cores - 1)")
    p.add_argument("--no-validate", action="store_true", help="skip the onnxruntime-vs-torch check of the export")
    s = p.add_argument_group("stepserve mode")
    s.add_argument("--strategy", default=None, choices=STRATEGIES, help=f"the engine's batching (default {DEFAULT_STRATEGY})")
    s.add_argument("--backend", default=None, choices=ENGINE_BACKENDS,
                   help="how the engine runs the networks (default onnxruntime; torch copies the diffusers folder)")
    c = p.add_argument_group("classic mode")
    c.add_argument("--network-backend", default=None, choices=NETWORK_BACKENDS,
                   help="python (default): onnxruntime inside the Python backend, runs on the tritonserver of "
                        "nvidia-pytriton; onnxruntime: Triton's own backend, for a stock Triton container")
    c.add_argument("--network-max-queue-delay-ms", type=_non_negative, default=None,
                   help="the network models' dynamic batcher delay (default 0: batch what is queued)")
    return p


def options_from(args: argparse.Namespace) -> RepositoryOptions:
    """RepositoryOptions from parsed flags; ValueError names a flag given for the other mode."""
    wrong = STEPSERVE_ONLY if args.mode == "classic" else CLASSIC_ONLY
    given = [f"--{name.replace('_', '-')}" for name in wrong if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} applies to --mode {'stepserve' if args.mode == 'classic' else 'classic'}"
                         f" only, not --mode {args.mode}")
    return RepositoryOptions(
        mode=args.mode, max_batch_size=args.max_batch_size, max_queue_delay_ms=args.max_queue_delay_ms,
        max_queue=args.max_queue, strategy=args.strategy or DEFAULT_STRATEGY, engine_backend=args.backend or "onnxruntime",
        network_backend=args.network_backend or "python",
        network_max_queue_delay_ms=args.network_max_queue_delay_ms or 0.0, threads=args.threads,
        validate=not args.no_validate)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = write_repository(args.model, args.out, options_from(args), force=args.force)
    except (OSError, ValueError, ExportError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    grpc = "gRPC streaming (Triton refuses decoupled models on plain HTTP/gRPC infer)" if args.mode == "stepserve" \
        else "HTTP or gRPC"
    print(f"{PROG}: serve it with `{shlex.quote(sys.executable)} -m stepserve.deploy.triton.server {out}` (or `tritonserver "
          f"--model-repository {out}`); the model `pipeline` answers over {grpc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
