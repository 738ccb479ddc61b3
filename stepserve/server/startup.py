"""Starting the server's engine from an EngineConfig: the same in one process (`stepserve serve`) and in every
Ray Serve replica (ray_serve.py)."""

from __future__ import annotations

import argparse
import sys

from ..engine_config import EngineConfig, EngineOptions, build_engine


class StartupError(Exception):
    """A flag or model that cannot be served; its message is the one-line error `stepserve serve` prints."""


def say(line: str) -> None:
    print(f"stepserve serve: {line}", file=sys.stderr, flush=True)


def start_engine(config: EngineConfig):
    """An AsyncEngine (not yet started) over what `config` names. Raises StartupError with a one-line message."""
    from ..async_engine import AsyncEngine
    from ..loading import check_model_argument

    try:
        check_model_argument(config.model)  # a one-line error before anything loads
    except FileNotFoundError as exc:
        raise StartupError(f"--{exc}") from None
    say(f"loading {config.model} on {config.device} ({config.dtype}, backend {config.backend}) ...")
    try:
        built = build_engine(config, say)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot load model {config.model!r}: {exc}") from None
    return AsyncEngine(built.executor, options=built.options)


def serve_options(args: argparse.Namespace) -> EngineOptions:
    """The engine options of the serve flags (slo measures its latency model at start-up unless given one)."""
    return EngineOptions(strategy=args.strategy, max_batch_size=args.max_batch_size,
                         max_queue_delay_ms=args.max_queue_delay_ms, max_queue=args.max_queue,
                         latency_model=args.latency_model or ("measure" if args.strategy == "slo" else None),
                         answer_margin_s=args.answer_margin_ms / 1000.0, slo_order=args.slo_order)


def build_engine_from_args(args: argparse.Namespace):
    """(AsyncEngine not yet started, ServerLimits, model name) from the serve flags."""
    from ..commands.flags import engine_config
    from .schemas import ServerLimits

    try:
        config = engine_config(args, serve_options(args), memory_cap=not args.no_memory_cap)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot load model {args.model!r}: {exc}") from None
    engine = start_engine(config)
    return engine, ServerLimits(max_n=args.max_n, default_timeout_s=args.timeout_s), engine.model.name
