"""`stepserve serve --replicas N`: the engine as a Ray Serve deployment, one continuous-batching engine per replica.

Each replica hosts the very app `stepserve serve` runs alone (create_app in server/app.py, through Serve's late-bound
`@serve.ingress()`), so routes, streaming, errors and per-replica admission (our 429s) are the same code. Ray's
HTTP proxy and router sit in front: a request goes to a replica with fewer than max_ongoing_requests in flight,
else waits in Ray's queue, and past max_queued_requests Ray answers 429 + Retry-After. Every answer from a replica
names it in X-Stepserve-Replica. /metrics, on whichever replica serves it, shows all replicas' metrics with a
`replica` label: each replica pushes a snapshot to a small hub actor every second (and its own at scrape time).

What outlives a request is shared through the state store (docs/SCALING.md): each replica opens the store that
--state names and the --results folder itself (only their names travel, never a connection), runs jobs under its
Ray replica id as their owner and holds adapters under that name, and reads the webhook secret from its own
environment. When Ray stops a replica (scale-down, serve.delete) it runs the app's lifespan shutdown: the replica
stops claiming jobs, gives the ones it runs the grace period, and hands back to the store what is unfinished.

The console's live view is an application of its own over every replica's steps (console.py).

With several models (`--model a=... --model b=...`), each replica hosts the several-model front instead, over every
model on its own shared device (replica_models.py): /metrics then shows the models of the replica that answers, and
the routers learn where each replica holds each model (docs/SCALING.md, "Several models behind the replicas").
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace

import ray
from ray import serve

from ...engine.loading import available_cores
from ..app import create_app
from ...store import STATE_ENV
from ...util.api_key import API_KEY_ENV
from ...util.urls import has_password
from ...util.words import plural
from ..startup import (WEBHOOK_SECRET_ENV, ServeSettings, StartupError, for_replicas, job_options, open_state,
                       ready_line, replica_api_key, replica_webhook_secret, start_engine)
from .console import EventsHubActor, deploy_console, start_forwarding, stop_console
from .fleet import autoscaling_stats, routing_stats
from .load import background_jobs
from .metrics import merge, snapshot
from .options import ReplicaPlan, deployment_options, replica_settings, stop_budget_s
from .processes import adopt_orphans, end_leftovers, reap, remove_session
from .proxy_errors import PROXY_CALLBACK, PROXY_CALLBACK_ENV
from .replica_models import ReplicaModels

APP_NAME = "stepserve"
PUSH_EVERY_S = 1.0
STALE_AFTER_S = 5.0  # a replica silent this long (killed, gone) drops out of /metrics

log = logging.getLogger("stepserve.server")


@ray.remote(num_cpus=0)
class MetricsHub:
    """The latest metrics snapshot of each replica, stamped with the hub's own clock (replicas may be on other
    machines)."""

    def __init__(self) -> None:
        self.latest: dict[str, tuple[float, list]] = {}

    def put(self, replica: str, families: list) -> None:
        self.latest[replica] = (time.monotonic(), families)

    def drop(self, replica: str) -> None:
        self.latest.pop(replica, None)

    def collect(self, max_age_s: float) -> dict[str, list]:
        now = time.monotonic()
        return {r: families for r, (at, families) in self.latest.items() if now - at <= max_age_s}


@serve.ingress()
class StepserveReplica:
    """One replica: an engine and the shared app over it, built when Ray starts the replica."""

    def __init__(self, settings: ServeSettings, threads: int, hub, events_hub, models=None) -> None:
        self.settings = replace(settings, engine=replace(settings.engine, threads=threads))
        self.models_config = None if models is None else models.with_engines(threads=threads)  # several models
        self.several: ReplicaModels | None = None
        self.hub = hub
        self.events_hub = events_hub  # the console's (console.py)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.engine = self.http_app = None  # (`app` is Serve's own name for the ASGI app it serves)
        self.pusher: asyncio.Task | None = None
        self.forwarder: asyncio.Task | None = None
        self.state: tuple = ()  # the store and results folder this replica opened

    async def __serve_build_asgi_app__(self):
        settings = self.settings
        api_key = replica_api_key(settings)  # StartupError fails the replica with its message
        webhook_secret = replica_webhook_secret(settings)
        store, results = self.state = open_state(settings)  # this replica's own connection to the shared state
        if self.models_config is not None:
            return self._build_models(api_key, webhook_secret, store, results)
        try:
            engine = self.engine = start_engine(settings.engine)
        except BaseException:
            self._close_state()
            raise
        app = create_app(engine, api_key=api_key, limits=settings.limits,
                         shutdown_grace_s=settings.shutdown_grace_s, replica=self.replica,
                         metrics_view=self.all_metrics, cors_origins=settings.cors_origins,
                         access_log=False,  # Ray Serve logs every request itself
                         store=store, results=results, owner=self.replica, webhook_secret=webhook_secret,
                         webhook_allow=settings.webhook_allow, listen_host=settings.host,
                         allowed_hosts=settings.allowed_hosts, **job_options(settings))
        self.http_app, self.metrics = app, app.state.server.metrics
        self.pusher = asyncio.get_running_loop().create_task(self._push_forever())
        self.forwarder = start_forwarding(self.events_hub, app, self.replica)
        return app

    def _build_models(self, api_key, webhook_secret, store, results):
        try:
            self.several = ReplicaModels(self.models_config, self.settings, store, results, self.replica, api_key,
                                         webhook_secret)
        except BaseException:
            self._close_state()
            raise
        self.http_app = self.several.dispatch
        replica_id = serve.get_replica_context().replica_id
        self.pusher = asyncio.get_running_loop().create_task(self.several.push_model_ids_forever(replica_id))
        return self.several.app

    async def all_metrics(self, own) -> bytes:
        try:
            await self._push()
            per_replica = await self.hub.collect.remote(STALE_AFTER_S)
        except ray.exceptions.RayError as exc:  # no hub (the server is stopping): this replica's own numbers
            log.warning("replica %s shows its own metrics only: %s", self.replica, exc)
            per_replica = {}
        per_replica[self.replica] = snapshot(own.registry)
        return merge(per_replica)

    async def _push(self) -> None:
        await self.hub.put.remote(self.replica, snapshot(self.metrics.registry))

    async def _push_forever(self) -> None:
        while True:
            try:
                await self._push()
            except ray.exceptions.RayError as exc:  # the hub is gone (the server is stopping): keep serving
                log.warning("replica %s cannot push metrics: %s", self.replica, exc)
            await asyncio.sleep(PUSH_EVERY_S)

    def background_jobs(self) -> int:
        """Jobs running here after their POST was answered: load Ray does not count (load.py)."""
        return self.several.background_jobs() if self.several else background_jobs(self.http_app)

    def record_routing_stats(self) -> dict:
        """Ray Serve asks every ROUTING_STATS_PERIOD_S: this replica's load, for the routers (router.py)."""
        if self.several is not None:
            return self.several.routing_stats()
        return routing_stats(self.engine, self.background_jobs())

    def record_autoscaling_stats(self) -> dict:
        """Ray Serve asks for the custom autoscaling policy: work in hand and jobs (fleet.py)."""
        if self.several is not None:
            return self.several.autoscaling_stats()
        return autoscaling_stats(self.engine, self.background_jobs())

    def check_health(self) -> None:
        """Ray Serve calls this periodically; a failed engine makes Ray replace the replica."""
        if self.engine is not None and not self.engine.healthy:
            raise RuntimeError(f"engine failed: {self.engine.failure}")
        failure = self.several.failure() if self.several is not None else None
        if failure:
            raise RuntimeError(f"engine failed: {failure}")

    async def __del__(self) -> None:
        """Ray Serve calls this once the app's lifespan shutdown has run (jobs handed back)."""
        for task in filter(None, (self.pusher, self.forwarder)):
            task.cancel()
        self.hub.drop.remote(self.replica)
        self.events_hub.leave.remote(self.replica)
        self._close_state()

    def _close_state(self) -> None:
        for opened in self.state[::-1]:  # the results folder (a temporary one goes), then the store
            opened.close()
        self.state = ()


def serve_replicas(settings: ServeSettings, plan: ReplicaPlan, models=None) -> int:
    """Start (or join) a Ray cluster, deploy the replicas, serve until SIGTERM/SIGINT, then take it all down.
    `models`: a server.models_setup.ModelsConfig, every replica then serving all of its models."""
    for note in plan.notes:
        print(f"stepserve serve: {note}", file=sys.stderr, flush=True)
    local = plan.ray_address is None
    if local and settings.api_key is not None and settings.api_key_file is None:
        os.environ[API_KEY_ENV] = settings.api_key  # the local cluster's processes inherit it; no argument carries it
    if local and settings.webhook_secret is not None:
        os.environ[WEBHOOK_SECRET_ENV] = settings.webhook_secret  # the same for the webhook secret
    if local and has_password(settings.state_url):
        os.environ[STATE_ENV] = settings.state_url  # and for the state URL's password (replica_state_url)
    _connect(plan, local)
    stop = _stop_on_signal()  # after ray.init, whose own SIGTERM handler would abort the process
    started_serve = False
    try:
        started_serve = not _serve_running()
        serve.start(http_options={"host": settings.host, "port": settings.port})
        hub, events_hub = MetricsHub.remote(), EventsHubActor.remote()
        deployment = serve.deployment(StepserveReplica, name="Engine", **deployment_options(plan))
        engine = settings.engine
        served = engine.model if models is None else f"models {', '.join(s.name for s in models.specs)}"
        if models is not None:
            models = models.with_engines(memory_share=plan.memory_share)
        print(f"stepserve serve: deploying {_replica_text(plan)} of {served} ({plural(plan.cpus, 'CPU')}, "
              f"{plural(plan.gpus, 'GPU')}, {plural(plan.threads, 'thread')} each) ...", file=sys.stderr, flush=True)
        try:
            serve.run(deployment.bind(for_replicas(replica_settings(settings, plan)), plan.threads, hub, events_hub,
                                      models), name=APP_NAME, route_prefix="/", blocking=False)
            deploy_console(settings, events_hub)
        except RuntimeError as exc:
            raise StartupError(f"the replicas did not start: {exc}") from None
        details = (f"{_replica_text(plan)}, Ray Serve, strategy {engine.options.strategy}, max batch "
                   f"{engine.options.max_batch_size} per replica")
        default = models.default if models is not None else engine.model
        print(f"stepserve serve: {ready_line(default, settings.host, settings.port, details)}", file=sys.stderr,
              flush=True)
        while not stop.wait(1.0):
            if local:
                reap()  # Ray workers that exited and were handed to us (the subreaper)
        print(f"stepserve serve: stopping the replicas (requests in flight may finish within {plan.grace_s:g} s) "
              f"...", file=sys.stderr, flush=True)
        _bounded(stop_console, 30.0, events_hub)
        _bounded(serve.delete, stop_budget_s(plan) + 15.0, APP_NAME)
        return 0
    finally:
        if started_serve and not local:  # a cluster we joined keeps running: take down the Serve we started there
            _bounded(serve.shutdown, 30.0)
        # (a local cluster stops whole with ray.shutdown below; serve.shutdown there only made Ray print that its
        # controller's graceful_shutdown task "failed" when the controller ended itself)
        session = _session_dir() if local else None
        ray.shutdown()  # a local cluster started by ray.init stops with it
        if local:
            end_leftovers()
            remove_session(session)


def _session_dir() -> str | None:
    """The local cluster's session folder (logs, sockets) under Ray's temporary directory, or None."""
    try:
        return ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:  # not connected, or a Ray without this (private) attribute
        return None


def _bounded(call, timeout_s: float, *args) -> None:
    """Run a teardown call, giving up after timeout_s (a cluster process killed from outside can make it hang)."""
    worker = threading.Thread(target=call, args=args, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        print(f"stepserve serve: {call.__name__} did not finish within {timeout_s:g} s; going on",
              file=sys.stderr, flush=True)


def _stop_on_signal() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _connect(plan: ReplicaPlan, local: bool) -> None:
    if local:
        # Loopback only: the cluster's own traffic never leaves this machine. Ray's own proxy errors (its queue
        # limit, a replica that died) get the OpenAI error shape (proxy_errors.py).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
        os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")  # fresh work in hand
        # Ray enables token authentication for a new local cluster by default (other users of this machine cannot
        # run code in it), and says so on every start: nothing to act on here, so not said
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        if not (sys.stdout.isatty() and sys.stderr.isatty()):
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no ANSI colour codes in a log file
        adopt_orphans()
        print(f"stepserve serve: starting a local Ray cluster ({available_cores()} CPUs, loopback) ...",
              file=sys.stderr, flush=True)
        ray.init(num_cpus=available_cores(), include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=True)
        session = _session_dir()
        if session:
            print(f"stepserve serve: the cluster's logs are in {session}/logs until it stops (then removed)",
                  file=sys.stderr, flush=True)
        return
    try:
        ray.init(address=plan.ray_address, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        hint = "" if os.environ.get("RAY_AUTH_MODE") else (
            "; a cluster with token authentication (Ray's default) needs RAY_AUTH_MODE=token here, and its token in "
            "~/.ray/auth_token or RAY_AUTH_TOKEN")
        raise StartupError(f"cannot join the Ray cluster at --ray-address {plan.ray_address!r}: {exc}{hint}") from None


def _serve_running() -> bool:
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _replica_text(plan: ReplicaPlan) -> str:
    if plan.autoscale:
        return f"{plural(plan.replicas, 'replica')} (autoscaling {plan.autoscale[0]}-{plan.autoscale[1]})"
    return plural(plan.replicas, "replica")
