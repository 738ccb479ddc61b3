"""`stepserve serve`: load a model, build the engine and the app, serve it with uvicorn.

On SIGTERM (or Ctrl-C) the server stops accepting image requests (503), lets the ones in flight finish within
--shutdown-grace-s, aborts whatever is left after that, and exits 0. A second signal stops at once.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

import uvicorn

from ..util.api_key import API_KEY_ENV, resolve_api_key
from ..util.extras import MissingExtraError
from ..engine.loading import available_cores, check_pairs, check_weights
from ..scheduling import DEFAULT_MAX_QUEUE_DELAY_MS, DEFAULT_STRATEGY, SLO_ORDERS, STRATEGIES
from ..engine.config import EngineOptions
from ..server.startup import (ServeSettings, StartupError, job_options, open_state, ready_line, say, start_engine,
                              state_line)
from .replica_flags import add_replica_flags, replica_mode
from .models_flags import add_models_flags, several
from .state_flags import add_state_flags, state_settings
from .network_flags import add_network_flags, network_settings
from .flags import (OneLineParser, model_of, add_cache_flag, add_controlnet_flag, add_fast_path_flags, add_lora_flag,
                    add_model_flags, add_parallel_flags, check_cache_and_lora_flags, check_checkpoint_flags,
                    degrees_from_args, engine_config, float_from, int_from)

_positive_float = float_from(0.0, inclusive=False, what="a positive number of seconds")
_non_negative_float = float_from(0.0, inclusive=True, what="a number >= 0")
AUTO = "auto"
DEFAULT_TIMEOUT_S = 600.0  # generous: a request nobody waits for any more does not hold its slot forever
QUEUE_PER_BATCH = 8  # the default --max-queue: this many full batches waiting


def queue_bound(text: str) -> int | str:
    """--max-queue: an integer >= 1; 0 or 'none' for unbounded (0 here); 'auto' for the default."""
    if text.strip().lower() in ("none", "0", AUTO):
        return 0 if text.strip().lower() != AUTO else AUTO
    try:
        return int_from(1)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, or 0 or 'none' for unbounded, got "
                                         f"{text!r}") from None


def optional_seconds(text: str) -> float | None:
    """--timeout-s: a positive number of seconds; 0 or 'none' for no default deadline."""
    if text.strip().lower() in ("none", "0", "0.0"):
        return None
    try:
        return _positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, or 0 or 'none' for no default "
                                         f"deadline, got {text!r}") from None


def default_max_queue(max_batch_size: int, max_n: int) -> int:
    """The queue bound a fresh install gets: QUEUE_PER_BATCH full batches, and room for the largest request."""
    return max(QUEUE_PER_BATCH * max_batch_size, max_n)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="stepserve serve", description="Serve the OpenAI-compatible images API over HTTP.")
    add_model_flags(p, repeatable=True, model_help=(
        "[NAME=]PATH: 'embedded', a local diffusers folder (model_index.json) or a single-file checkpoint; "
        "repeatable: several models on one device, each request picking one by its \"model\" (NAME: how requests "
        "name it, default the folder's name; docs/MODELS.md, \"Several models\")"))
    add_models_flags(p)
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, choices=STRATEGIES,
                   help=f"batching strategy (default {DEFAULT_STRATEGY}: deadline- and cost-aware, see the README)")
    p.add_argument("--max-batch-size", type=int_from(1), default=8, help="most requests in one denoising step")
    p.add_argument("--max-queue-delay-ms", type=_non_negative_float, default=DEFAULT_MAX_QUEUE_DELAY_MS,
                   help="dynamic batching: longest wait for a fuller batch")
    p.add_argument("--max-queue", type=queue_bound, default=AUTO,
                   help="waiting requests beyond this get 429 at once (default: 8 x --max-batch-size, at least "
                        "--max-n; 0 or 'none': unbounded)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_from(1, 65535), default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (visible in `ps`: prefer "
                        f"--api-key-file or the {API_KEY_ENV} environment variable)")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="let web pages from this origin (e.g. https://app.example.com) call the API; repeatable; "
                        "default: none (browsers then refuse cross-origin calls)")
    p.add_argument("--timeout-s", type=optional_seconds, default=DEFAULT_TIMEOUT_S,
                   help=f"default deadline of a request without its own timeout_s (504 when passed; default "
                        f"{DEFAULT_TIMEOUT_S:g}; 0 or 'none': no deadline)")
    p.add_argument("--shutdown-grace-s", type=_non_negative_float, default=30.0,
                   help="on SIGTERM, how long requests in flight may take to finish")
    p.add_argument("--max-n", type=int_from(1, 64), default=8, help="largest n (images per request)")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME", type=_model_alias,
                   help="another name a request's \"model\" may give (e.g. one your clients send, such as "
                        "dall-e-3), listed at /v1/models; repeatable. A request naming any other model gets 404 "
                        "model_not_found (the model's own name always works; no \"model\": the one served)")
    p.add_argument("--latency-model", default=None, metavar="PATH|measure",
                   help="slo strategy: the latency model it predicts with, a file written by `stepserve profile` "
                        "or 'measure' (time this model on this device at start-up, a few seconds; the default "
                        "for --strategy slo)")
    p.add_argument("--slo-order", default="srs", choices=SLO_ORDERS,
                   help="slo strategy: order within a priority, shortest remaining steps first (srs) or earliest "
                        "deadline first (edf)")
    p.add_argument("--answer-margin-ms", type=_non_negative_float, default=10.0,
                   help="time kept before each request's deadline to encode and send the answer: an image ready "
                        "later than timeout_s minus this is a 504, so no 200 arrives after its deadline")
    p.add_argument("--no-memory-cap", action="store_true",
                   help="skip the start-up check that lowers --max-batch-size to what fits in memory (for the "
                        "model's largest size, measured near 256x256 and scaled by the pixels; 20%% headroom)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="log level of the server (uvicorn) and of stepserve's own lines, the access log included")

    add_replica_flags(p)
    add_fast_path_flags(p)
    add_parallel_flags(p)
    add_cache_flag(p)
    add_lora_flag(p)
    add_controlnet_flag(p)
    p.add_argument("--no-access-log", action="store_true",
                   help="no log line per image or video request (method, path, status, outcome, latency, steps, "
                        "batch sizes)")
    add_state_flags(p)
    add_network_flags(p)
    return p


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """What the serve flags ask for, as plain data: the same for one process and for every Ray Serve replica."""
    from ..server.schemas import ServerLimits

    max_queue = (default_max_queue(args.max_batch_size, args.max_n) if args.max_queue == AUTO
                 else args.max_queue or None)
    options = EngineOptions(strategy=args.strategy, max_batch_size=args.max_batch_size,
                            max_queue_delay_ms=args.max_queue_delay_ms, max_queue=max_queue,
                            latency_model=args.latency_model or ("measure" if args.strategy == "slo" else None),
                            answer_margin_s=args.answer_margin_ms / 1000.0, slo_order=args.slo_order)
    check_cache_and_lora_flags(args)
    try:
        config = engine_config(args, options, memory_cap=not args.no_memory_cap)
    except MissingExtraError as exc:
        raise StartupError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot load model {args.model!r}: {exc}") from None
    try:  # the pairs of weights flags (--quantize, --offload, a GGUF file) with the add-on folders; the degrees
        # (a replica on a cluster elsewhere sees the GPUs it reserves: --replica-gpus follows the degree)
        remote = getattr(args, "ray_address", None) is not None
        check_pairs(config, gpus=config.degrees.world if remote and config.degrees is not None else None)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    try:  # --quantize's device and library, --offload's device: one line before anything loads (here, unless the
        # replicas run on a cluster elsewhere, whose machines have libraries of their own: each replica checks)
        if getattr(args, "ray_address", None) is None:
            check_weights(config.weights, config.device, config.backend)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    limits = ServerLimits(max_n=args.max_n, default_timeout_s=args.timeout_s,
                          served_model_names=tuple(args.served_model_name or ()))
    return ServeSettings(config, limits, api_key,
                         args.shutdown_grace_s, args.host, args.port,
                         api_key_file=os.path.abspath(args.api_key_file) if args.api_key_file else None,
                         cors_origins=tuple(args.cors_origin or ()), access_log=not args.no_access_log,
                         **state_settings(args), **network_settings(args))


def _model_alias(value: str) -> str:
    """--served-model-name: a name a client can send and a URL path can carry (GET /v1/models/{name})."""
    if not value.strip() or len(value) > 200 or any(c.isspace() or not c.isprintable() for c in value):
        raise argparse.ArgumentTypeError(f"{value[:40]!r}: allowed: a name of 1 to 200 printable characters, "
                                         "without spaces")
    return value


def log_to_stderr(level: str) -> None:
    """stepserve's own log lines (the access log, batch-cap changes, engine failures) on stderr at --log-level,
    in uvicorn's layout."""
    logger = logging.getLogger("stepserve")
    if not any(getattr(h, "stepserve_serve", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        handler.stepserve_serve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def check_model(args: argparse.Namespace) -> None:
    """--model (and --config) name something loadable: one line before anything loads."""
    from ..engine.loading import check_model_argument

    try:
        check_checkpoint_flags(args)
        check_model_argument(model_of(args))
    except FileNotFoundError as exc:  # "model: ...": the folder is --config's with a whole-model file
        flag = "--config" if model_of(args) != args.model else "--model"
        raise StartupError(str(exc).replace("model", flag, 1)) from None
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def claim_port(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, opened before anything loads: a busy port fails at once, not after the
    model has loaded. One process serves on it; Ray Serve's proxy binds its own (close this one first)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise StartupError(f"cannot listen on --host {host!r} --port {port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: no wait after a restart
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        busy = "address already in use: another server listens there; stop it or choose another --port" \
            if exc.errno == errno.EADDRINUSE else str(exc)
        raise StartupError(f"cannot listen on {host}:{port}: {busy}") from None
    return sock


def serve_on_replicas(args: argparse.Namespace, models=None) -> int:
    """`serve --replicas` (or --autoscale, --ray-address): Ray Serve replicas of the model, or of every model of a
    server of several (`models`: a server.models_setup.ModelsConfig). Raises StartupError."""
    from ..server.ray.options import plan_replicas

    plan = plan_replicas(args, available_cores(), degrees_from_args(args))
    try:
        from ..server.ray.deployment import serve_replicas
    except ImportError as exc:
        raise StartupError(f"--replicas needs Ray Serve: install stepserve[ray] ({exc})") from None
    if args.ray_address is None:  # a local cluster: Ray's proxy will bind the port; is it free now?
        claim_port(args.host, args.port).close()
    settings = serve_settings(args)
    for opened in open_state(settings)[::-1]:  # one line here, not every replica failing to start
        opened.close()
    say(state_line(settings, settings.results_dir or "each replica's results folder", replicas=True))
    return serve_replicas(settings, plan, models)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if several(args):
        from .serve_models import serve_models

        return serve_models(args, serve_settings, check_model, claim_port, log_to_stderr, parser,
                            serve_on_replicas)
    sock = store = results = None
    try:
        if replica_mode(args):
            return serve_on_replicas(args)
        check_model(args)
        sock = claim_port(args.host, args.port)  # before anything loads (or exports)
        settings = serve_settings(args)
        store, results = open_state(settings)  # a state that cannot be opened fails before the model loads
        engine = start_engine(settings.engine)
    except StartupError as exc:
        if sock is not None:
            sock.close()
        if store is not None:
            store.close()
            results.close()
        print(f"stepserve serve: error: {exc}", file=sys.stderr)
        return 2
    from ..server.app import create_app
    from ..server.draining import DrainingServer

    name = engine.model_info.name
    app = create_app(engine, api_key=settings.api_key, limits=settings.limits,
                     shutdown_grace_s=settings.shutdown_grace_s, cors_origins=settings.cors_origins,
                     access_log=settings.access_log, store=store, results=results,
                     owner=f"{socket.gethostname()}:{args.port}",  # the same after a restart: its jobs come back
                     webhook_secret=settings.webhook_secret, webhook_allow=settings.webhook_allow,
                     listen_host=settings.host, allowed_hosts=settings.allowed_hosts, **job_options(settings))
    log_to_stderr(args.log_level)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=max(5.0, args.shutdown_grace_s))
    extras = []
    if engine.model_info.default_cache is not None:
        spec = engine.model_info.default_cache
        extras.append(f"cache {spec.policy} by default")
    if settings.engine.lora_dir:
        extras.append(f"LoRA adapters from {settings.engine.lora_dir}")
    weights = settings.engine.weights
    if weights is not None and weights.changed:
        extras.append(weights.summary())
    if settings.limits.served_model_names:
        extras.append(f"also named {', '.join(settings.limits.served_model_names)}")
    if settings.api_key:
        extras.append("API key required" + (f" (from {settings.api_key_file})" if settings.api_key_file else ""))
    details = f"strategy {args.strategy}, max batch {args.max_batch_size}{''.join(', ' + e for e in extras)}"
    say(state_line(settings, results.root, service=app.state.server.jobs.service))
    print(f"stepserve serve: {ready_line(name, args.host, args.port, details)}", file=sys.stderr, flush=True)
    try:
        DrainingServer(config, app, args.shutdown_grace_s).run(sockets=[sock])
    finally:
        sock.close()
        store.close()
        results.close()  # a temporary folder (--state memory) goes; any other stays
    return 0
