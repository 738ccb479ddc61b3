"""Building the engine from the serve flags: the same in one process (`stepserve serve`) and in every Ray Serve
replica (ray_serve.py), so neither imports the other's command line for it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (taskset, a container's cpuset), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API on this platform
        return os.cpu_count() or 1


def default_threads() -> int:
    """All cores but one, at least 1. The spare core runs the event loop and the HTTP work; with a thread on every
    core, torch's OpenMP threads spin-wait for a core the server holds, and steps under load get much slower."""
    return max(1, available_cores() - 1)


class StartupError(Exception):
    """A flag or model that cannot be served; its message is the one-line error `stepserve serve` prints."""


def build_engine(args: argparse.Namespace):
    """(AsyncEngine not yet started, ServerLimits, model name) from the serve flags: the same in one process and in
    every Ray Serve replica. Raises StartupError with a one-line message."""
    folder = Path(args.model).expanduser()
    if args.model != "embedded" and not any((folder / f).is_file() for f in ("model_index.json", "manifest.json")):
        raise StartupError(f"--model {args.model!r} is neither 'embedded' nor a local diffusers folder with "
                           f"model_index.json (nor an export folder with manifest.json)")

    import torch

    torch.set_num_threads(args.threads)
    from ..api import load_executor
    from ..async_engine import AsyncEngine
    from .schemas import ServerLimits

    print(f"stepserve serve: loading {args.model} on {args.device} ({args.dtype}, backend {args.backend}) ...",
          file=sys.stderr, flush=True)
    try:
        executor = load_executor(args.model, args.device, args.dtype, args.backend, threads=args.threads)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot load model {args.model!r}: {exc}") from None
    if args.backend != "torch" and not args.no_memory_cap:
        print(f"stepserve serve: no memory cap on backend {args.backend}: the check measures torch's allocator",
              file=sys.stderr, flush=True)
    elif not args.no_memory_cap:
        from ..profiling import cap_max_batch_size

        args.max_batch_size, why = cap_max_batch_size(executor, args.max_batch_size)
        print(f"stepserve serve: {why}", file=sys.stderr, flush=True)
    from ..backends.fast_path import apply_fast_path, fast_path_from_args

    try:
        apply_fast_path(executor, fast_path_from_args(args), args.max_batch_size)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    latency_model = args.latency_model or ("measure" if args.strategy == "slo" else None)
    if latency_model == "measure":
        print("stepserve serve: measuring the step latency of this model for the slo strategy ...",
              file=sys.stderr, flush=True)
    try:
        engine = AsyncEngine(executor, strategy=args.strategy, max_batch_size=args.max_batch_size,
                             max_queue_delay_ms=args.max_queue_delay_ms, max_queue=args.max_queue,
                             latency_model=latency_model, answer_margin_s=args.answer_margin_ms / 1000.0,
                             slo_order=args.slo_order)
    except (OSError, ValueError) as exc:
        raise StartupError(f"--latency-model {args.latency_model!r}: {exc}") from None
    limits = ServerLimits(max_n=args.max_n, default_timeout_s=args.timeout_s)
    return engine, limits, executor.model.name
