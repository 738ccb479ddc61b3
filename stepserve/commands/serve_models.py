"""`stepserve serve` with several models (commands/models_flags.py says which): one engine and app per model on
one shared device (server/models.py, engine/device.py), behind one front (server/dispatch.py)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import socket
import sys
from dataclasses import dataclass
from typing import Any

import uvicorn

from ..scheduling.device_share import DeviceShare
from ..server.startup import StartupError, job_options, open_state, ready_line, say, state_line
from .models_flags import model_specs


@dataclass
class Front:
    """What a server of several models runs: the front app, its models, and what they share."""

    dispatch: Any  # server/dispatch.Dispatch
    models: Any  # server/models.ModelSet
    settings: Any  # the default model's ServeSettings (the key, the limits, the state: shared by all)
    store: Any
    results: Any

    def close(self) -> None:
        self.store.close()
        self.results.close()


def build_front(args: argparse.Namespace, serve_settings, check_model, parser) -> Front:
    """The models the flags name, the eager ones loaded, behind their front (not yet serving). `serve_settings`,
    `check_model` and `parser`: serve.py's, run for every model. Raises StartupError with a one-line message."""
    if getattr(args, "replicas", None) is not None or getattr(args, "autoscale", None) is not None:
        raise StartupError("several models with --replicas or --autoscale: allowed: one model per replica "
                           "(route by model in front of the replicas)")

    def config_of(own: argparse.Namespace):
        check_model(own)
        return serve_settings(own).engine

    specs, default = model_specs(args, config_of, parser)
    specs = [dataclasses.replace(s, aliases=(*s.aliases, *(args.served_model_name or ()))) if s.name == default
             else s for s in specs]  # --served-model-name: more names of the default model
    first = copy.copy(args)
    first.model = next(s.config.model for s in specs if s.name == default)
    settings = serve_settings(first)
    store, results = open_state(settings)
    try:
        models = _model_set(specs, default, settings, store, results, args)
        for entry in models.entries.values():
            if entry.spec.eager:
                say(f"loading model {entry.name} from {entry.spec.config.model} ...")
                models.load_now(entry)
    except BaseException:
        store.close()
        results.close()
        raise
    from ..server.dispatch import Dispatch

    return Front(Dispatch(models, settings.api_key, settings.limits.default_timeout_s), models, settings, store,
                 results)


def serve_models(args: argparse.Namespace, serve_settings, check_model, claim_port, log_to_stderr, parser) -> int:
    """serve's main for several models; the single-model steps it shares come from serve.py."""
    sock = None
    try:
        sock = claim_port(args.host, args.port)
        front = build_front(args, serve_settings, check_model, parser)
    except StartupError as exc:
        if sock is not None:
            sock.close()
        print(f"stepserve serve: error: {exc}", file=sys.stderr)
        return 2
    from ..server.draining import DrainingServer
    from ..server.hosts import HostCheck, ServedHosts

    settings, models = front.settings, front.models
    app = front.dispatch if settings.api_key else HostCheck(front.dispatch, ServedHosts.of(settings.host,
                                                                                          settings.allowed_hosts))
    log_to_stderr(args.log_level)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            lifespan="on", timeout_graceful_shutdown=max(5.0, args.shutdown_grace_s))
    lazy = [e.name for e in models.entries.values() if not e.spec.eager]
    details = (f"{len(models.entries)} models: {', '.join(models.entries)} (default {models.default}"
               f"{'; loaded on first use: ' + ', '.join(lazy) if lazy else ''})")
    say(state_line(settings, front.results.root, service="one per model"))
    print(f"stepserve serve: {ready_line(models.default, args.host, args.port, details)}", file=sys.stderr,
          flush=True)
    try:
        DrainingServer(config, front.dispatch, args.shutdown_grace_s).run(sockets=[sock])
    finally:
        sock.close()
        front.close()
    return 0


def _model_set(specs, default, settings, store, results, args):
    from ..engine.device import SharedDevice
    from ..server.app import create_app
    from ..server.jobs_app import default_service
    from ..server.models import ModelSet

    mib = 2**20
    device = SharedDevice(DeviceShare({s.name: s.weight for s in specs}),
                          None if args.device_memory_mb is None else int(args.device_memory_mb * mib),
                          None if args.host_memory_mb is None else int(args.host_memory_mb * mib))
    served = [n for s in specs for n in (s.name, *s.aliases)]
    owner = f"{socket.gethostname()}:{args.port}"

    def make_app(spec, engine):
        aliases = (spec.name, *spec.aliases)
        limits = dataclasses.replace(settings.limits, served_model_names=aliases,
                                     other_models=tuple(n for n in served if n not in aliases))
        info = dataclasses.replace(engine.model_info, name=spec.name)
        service = f"{settings.service}-{spec.name}"[:100] if settings.service else default_service(info)
        return create_app(engine, api_key=settings.api_key, limits=limits, shutdown_grace_s=settings.shutdown_grace_s,
                          cors_origins=settings.cors_origins, access_log=settings.access_log, store=store,
                          results=results, owner=owner, webhook_secret=settings.webhook_secret,
                          webhook_allow=settings.webhook_allow, **{**job_options(settings), "service": service})

    return ModelSet(specs, default, device, make_app)
