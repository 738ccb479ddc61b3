"""Starting the server's engine: the same in one process (`stepserve serve`) and in every Ray Serve replica
(ray/deployment.py). ServeSettings is what the serve flags ask for, as plain data that can travel to a replica."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..engine_config import EngineConfig, build_engine
from .schemas import ServerLimits


@dataclass(frozen=True)
class ServeSettings:
    engine: EngineConfig  # what to load and how it batches (max_batch_size before the memory cap)
    limits: ServerLimits  # per-request limits of the HTTP API
    api_key: str | None = None  # required as a bearer token on every route but /health
    shutdown_grace_s: float = 30.0  # on SIGTERM, how long requests in flight may take to finish
    host: str = "127.0.0.1"
    port: int = 8000


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
