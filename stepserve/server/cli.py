"""`stepserve serve`: load a model, build the engine and the app, serve it with uvicorn.

On SIGTERM (or Ctrl-C) the server stops accepting image requests (503), lets the ones in flight finish within
--shutdown-grace-s, aborts whatever is left after that, and exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

import uvicorn

from ..api import DEVICES, DTYPES
from ..arg_types import float_from, int_from
from ..backends import BACKENDS
from ..scheduling import DEFAULT_MAX_QUEUE_DELAY_MS, SLO_ORDERS, STRATEGIES
from .startup import StartupError, available_cores, build_engine, default_threads


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"stepserve serve: error: {message}\n")


_int_from = int_from
_float_from = float_from
_positive_float = _float_from(0.0, inclusive=False, what="a positive number of seconds")
_non_negative_float = _float_from(0.0, inclusive=True, what="a number >= 0")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="stepserve serve", description="Serve the OpenAI-compatible images API over HTTP.")
    p.add_argument("--model", default="embedded", help="'embedded' or a local diffusers folder (model_index.json)")
    p.add_argument("--strategy", default="continuous", choices=STRATEGIES, help="batching strategy")
    p.add_argument("--max-batch-size", type=_int_from(1), default=8)
    p.add_argument("--max-queue-delay-ms", type=_non_negative_float, default=DEFAULT_MAX_QUEUE_DELAY_MS,
                   help="dynamic batching: longest wait for a fuller batch")
    p.add_argument("--max-queue", type=_int_from(1), default=None,
                   help="waiting requests beyond this get 429 at once (default: unbounded)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_int_from(1, 65535), default=8000)
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--backend", default="torch", choices=BACKENDS,
                   help="how the networks run (samplers are torch on all): torch; onnxruntime (CPU, float32; "
                        "--model may be an ONNX export, else the model is exported once into a cache); tensorrt "
                        "(--model is a folder from `stepserve export tensorrt`, needs --device cuda)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--timeout-s", type=_positive_float, default=None,
                   help="default deadline of a request without its own timeout_s (504 when passed)")
    p.add_argument("--shutdown-grace-s", type=_non_negative_float, default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish")
    p.add_argument("--max-n", type=_int_from(1, 64), default=8, help="largest n (images per request)")
    p.add_argument("--threads", type=_int_from(1), default=default_threads(),
                   help="torch intra-op CPU threads (default: the cores this process may use minus one, at least 1; "
                        "%(default)s here): the spare core serves HTTP, so torch's threads do not spin-wait on it")
    p.add_argument("--latency-model", default=None, metavar="PATH|measure",
                   help="slo strategy: the latency model it predicts with, a file written by `stepserve profile` "
                        "or 'measure' (time this model on this device at start-up, a few seconds; the default "
                        "for --strategy slo)")
    p.add_argument("--slo-order", default="srs", choices=SLO_ORDERS,
                   help="slo strategy: order within a priority, shortest remaining steps first (srs, the "
                        "default) or earliest deadline first (edf)")
    p.add_argument("--answer-margin-ms", type=_non_negative_float, default=10.0,
                   help="time kept before each request's deadline to encode and send the answer: an image ready "
                        "later than timeout_s minus this is a 504, so no 200 arrives after its deadline "
                        "(default %(default)s)")
    p.add_argument("--no-memory-cap", action="store_true",
                   help="skip the start-up check that lowers --max-batch-size to what fits in memory (measured at "
                        "the model's largest size, 20%% headroom)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    from .ray.options import add_replica_flags

    add_replica_flags(p)
    from ..backends.fast_path import add_fast_path_flags

    add_fast_path_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if replica_mode(args):
            from .ray.options import plan_replicas

            plan = plan_replicas(args, available_cores())
            try:
                from .ray.deployment import serve_replicas
            except ImportError as exc:
                raise StartupError(f"--replicas needs Ray Serve: install stepserve[ray] ({exc})") from None
            return serve_replicas(args, plan)
        engine, limits, name = build_engine(args)
    except StartupError as exc:
        print(f"stepserve serve: error: {exc}", file=sys.stderr)
        return 2
    from .app import create_app

    app = create_app(engine, api_key=args.api_key, limits=limits, shutdown_grace_s=args.shutdown_grace_s)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=max(5.0, args.shutdown_grace_s))
    print(f"stepserve serve: {name} on http://{args.host}:{args.port}/v1 "
          f"(strategy {args.strategy}, max batch {args.max_batch_size})", file=sys.stderr, flush=True)
    DrainingServer(config, app, args.shutdown_grace_s).run()
    return 0


def replica_mode(args: argparse.Namespace) -> bool:
    """Ray Serve replicas (stepserve/server/ray_serve.py) instead of one process; replica flags need it."""
    if args.replicas is not None or args.autoscale is not None or args.ray_address is not None:
        return True
    alone = [flag for flag, value in (("--replica-cpus", args.replica_cpus), ("--replica-gpus", args.replica_gpus),
                                      ("--max-ongoing-requests", args.max_ongoing_requests),
                                      ("--max-queued-requests", args.max_queued_requests),
                                      ("--target-ongoing-requests", args.target_ongoing_requests))
             if value is not None]
    if alone:
        raise StartupError(f"{', '.join(alone)} only apply to Ray Serve replicas; add --replicas N (or --autoscale "
                           f"MIN:MAX)")
    return False


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains instead of closing the door on requests in flight."""

    def __init__(self, config: uvicorn.Config, app, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:  # runs as a signal handler in the loop's thread
        if self.draining or self.loop is None:  # a second signal: stop now
            self.should_exit = True
            self.force_exit = self.draining and sig == signal.SIGINT
            return
        self.draining = True
        self.loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        assert self.loop is not None
        self.drain_task = self.loop.create_task(drain(self.app, self, self.grace_s))


async def drain(app, server, grace_s: float) -> None:
    """Refuse new work, wait for the work in flight (at most grace_s), abort the rest, then let uvicorn exit."""
    from .app import is_idle, start_drain

    start_drain(app)
    deadline = time.monotonic() + grace_s
    while not is_idle(app) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if not is_idle(app):
        await app.state.server.engine.shutdown(0.0)  # the requests left get 503
        settle = time.monotonic() + 2.0
        while app.state.server.inflight and time.monotonic() < settle:
            await asyncio.sleep(0.02)
    server.should_exit = True
