"""`stepserve serve` with several models (commands/models_flags.py says which): one engine and app per model on
one shared device (server/models.py, engine/device.py), behind one front (server/dispatch.py); with --replicas or
--autoscale, every Ray Serve replica builds all of them (server/ray/deployment.py)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import socket
import sys
from dataclasses import dataclass
from typing import Any

import uvicorn

from ..server.models_setup import ModelsConfig, front, load_eager, model_set
from ..server.startup import StartupError, open_state, ready_line, say, state_line
from .models_flags import model_specs
from .replica_flags import replica_mode


@dataclass
class Front:
    """What a server of several models runs in one process: the front, the app to serve (the front behind the
    Host check without a key), its models, and what they share."""

    dispatch: Any  # server/dispatch.Dispatch
    app: Any
    models: Any  # server/models.ModelSet
    settings: Any  # the default model's ServeSettings (the key, the limits, the state: shared by all)
    store: Any
    results: Any

    def close(self) -> None:
        self.store.close()
        self.results.close()


def models_config(args: argparse.Namespace, serve_settings, check_model, parser) -> ModelsConfig:
    """The models the flags name, as plain data (what travels to each replica). `serve_settings`, `check_model`
    and `parser`: serve.py's, run for every model. Sets args.model to the default model's path."""
    def config_of(own: argparse.Namespace):
        check_model(own)
        return serve_settings(own).engine

    specs, default = model_specs(args, config_of, parser)
    specs = [dataclasses.replace(s, aliases=(*s.aliases, *(args.served_model_name or ()))) if s.name == default
             else s for s in specs]  # --served-model-name: more names of the default model
    args.model = next(s.config.model for s in specs if s.name == default)
    return ModelsConfig.of(specs, default, args.device_memory_mb, args.host_memory_mb)


def build_front(args: argparse.Namespace, config: ModelsConfig, serve_settings) -> Front:
    """The models of `config`, the eager ones loaded, behind their front (not yet serving). Raises StartupError."""
    settings = serve_settings(copy.copy(args))
    store, results = open_state(settings)
    try:
        models = model_set(config, settings, store, results, owner=f"{socket.gethostname()}:{args.port}")
        load_eager(models)
    except BaseException:
        store.close()
        results.close()
        raise
    dispatch, app = front(models, settings, settings.api_key)
    return Front(dispatch, app, models, settings, store, results)


def serve_models(args: argparse.Namespace, serve_settings, check_model, claim_port, log_to_stderr, parser,
                 on_replicas=None) -> int:
    """serve's main for several models; the single-model steps it shares come from serve.py (`on_replicas(args,
    models)`: serve's --replicas path, each replica then building these models itself)."""
    sock = None
    try:
        config = models_config(args, serve_settings, check_model, parser)
        if on_replicas is not None and replica_mode(args):
            return on_replicas(args, config)
        sock = claim_port(args.host, args.port)
        built = build_front(args, config, serve_settings)
    except StartupError as exc:
        if sock is not None:
            sock.close()
        print(f"stepserve serve: error: {exc}", file=sys.stderr)
        return 2
    from ..server.draining import DrainingServer

    models = built.models
    log_to_stderr(args.log_level)
    uv = uvicorn.Config(built.app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                        lifespan="on", timeout_graceful_shutdown=max(5.0, args.shutdown_grace_s))
    lazy = [e.name for e in models.entries.values() if not e.spec.eager]
    details = (f"{len(models.entries)} models: {', '.join(models.entries)} (default {models.default}"
               f"{'; loaded on first use: ' + ', '.join(lazy) if lazy else ''})")
    say(state_line(built.settings, built.results.root, service="one per model"))
    print(f"stepserve serve: {ready_line(models.default, args.host, args.port, details)}", file=sys.stderr,
          flush=True)
    try:
        DrainingServer(uv, built.dispatch, args.shutdown_grace_s).run(sockets=[sock])
    finally:
        sock.close()
        built.close()
    return 0
