"""`stepserve serve` with several models (commands/models_flags.py says which): one engine and app per model on
one shared device (server/models.py, engine/device.py), behind one front (server/dispatch.py); with --replicas or
--autoscale, every Ray Serve replica builds all of them (server/ray/deployment.py)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import socket
import sys

import uvicorn

from ..server.models_setup import ModelsConfig, front, load_eager, model_set
from ..server.startup import StartupError, open_state, ready_line, say, state_line
from .models_flags import model_specs
from .replica_flags import replica_mode


def serve_models(args: argparse.Namespace, serve_settings, check_model, claim_port, log_to_stderr,
                 on_replicas=None) -> int:
    """serve's main for several models; the single-model steps it shares come from serve.py (`on_replicas(args,
    models)`: serve's --replicas path, each replica then building these models itself)."""
    sock = store = results = None
    try:
        def config_of(own: argparse.Namespace):
            check_model(own)
            return serve_settings(own).engine

        specs, default = model_specs(args, config_of)
        specs = [dataclasses.replace(s, aliases=(*s.aliases, *(args.served_model_name or ()))) if s.name == default
                 else s for s in specs]  # --served-model-name: more names of the default model
        config = ModelsConfig.of(specs, default, args.device_memory_mb, args.host_memory_mb)
        args.model = next(s.config.model for s in specs if s.name == default)
        if on_replicas is not None and replica_mode(args):
            return on_replicas(args, config)
        sock = claim_port(args.host, args.port)
        settings = serve_settings(copy.copy(args))
        store, results = open_state(settings)
        models = model_set(config, settings, store, results, owner=f"{socket.gethostname()}:{args.port}")
        load_eager(models)
    except StartupError as exc:
        for opened in (sock, store, results):
            if opened is not None:
                opened.close()
        print(f"stepserve serve: error: {exc}", file=sys.stderr)
        return 2
    from ..server.draining import DrainingServer

    dispatch, app = front(models, settings, settings.api_key)
    log_to_stderr(args.log_level)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=max(5.0, args.shutdown_grace_s))
    lazy = [e.name for e in models.entries.values() if not e.spec.eager]
    details = (f"{len(specs)} models: {', '.join(models.entries)} (default {default}"
               f"{'; loaded on first use: ' + ', '.join(lazy) if lazy else ''})")
    say(state_line(settings, results.root, service="one per model"))
    print(f"stepserve serve: {ready_line(default, args.host, args.port, details)}", file=sys.stderr, flush=True)
    try:
        DrainingServer(config, dispatch, args.shutdown_grace_s).run(sockets=[sock])
    finally:
        sock.close()
        store.close()
        results.close()
    return 0
