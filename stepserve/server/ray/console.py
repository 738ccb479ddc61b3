"""`stepserve serve --replicas N`: one live view of every replica's engine, through Ray Serve (docs/SCALING.md,
"The console across replicas").

- The hub (events_hub.py) runs as one actor of no CPU, created by `serve` beside the metrics hub.
- Every engine replica forwards its step records to it while anyone watches (fleet_events.forward), each record
  labelled with the replica's id (the X-Stepserve-Replica of its answers).
- `/v1/engine/events` is served by an application of its own, CONSOLE_APP, under the route prefix EVENTS_ROUTE:
  Ray's proxy sends a path to the application with the longest route prefix that matches it, so the stream goes
  there and every other path to the engine replicas (prefix "/"). It is one replica of no CPU and no engine, with
  max_ongoing_requests of its own: open streams hold none of the engine replicas' request slots. It answers past
  MAX_VIEWERS itself (429), well below its Ray limit, so Ray never queues a viewer.
- On stop, `serve` closes the hub first: every stream ends, then the console's application and the replicas go.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from ray import serve

from ..console import events_app
from ..hosts import HostCheck, ServedHosts
from ..startup import ServeSettings, for_replicas, replica_api_key
from ..viewers import MAX_VIEWERS
from .events_hub import EventsHub
from .fleet_events import FleetEvents, forward

CONSOLE_APP = "stepserve-console"
EVENTS_ROUTE = "/v1/engine/events"

EventsHubActor = ray.remote(num_cpus=0)(EventsHub)
log = logging.getLogger("stepserve.server")


def console_options() -> dict:
    """Keyword arguments for `ray.serve.deployment(...)` of the console's stream."""
    return {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": 2 * MAX_VIEWERS,  # past MAX_VIEWERS the app's own 429 answers at once
            "graceful_shutdown_timeout_s": 2.0, "graceful_shutdown_wait_loop_s": 0.5}


@serve.ingress()
class ConsoleEvents:
    """The console's stream: FleetEvents over the hub, behind the API key (found where the replica starts, as the
    engine replicas find it)."""

    def __init__(self, settings: ServeSettings, hub) -> None:
        self.settings = settings
        self.hub = hub
        self.name = "console-" + serve.get_replica_context().replica_id.unique_id
        self.events: FleetEvents | None = None
        self.reader: asyncio.Task | None = None

    async def __serve_build_asgi_app__(self):
        api_key = replica_api_key(self.settings)
        self.events = FleetEvents(self.hub, self.name)
        self.reader = asyncio.get_running_loop().create_task(self.events.run())  # here, outside any request
        app = events_app(self.events, api_key, self.settings.cors_origins, name=self.name)
        if not api_key:  # the same Host check as the engine replicas' (hosts.py)
            app = HostCheck(app, ServedHosts.of(self.settings.host, self.settings.allowed_hosts))
        return _whole_path(app)

    async def __del__(self) -> None:
        if self.events is not None:
            self.events.close()
        if self.reader is not None:
            self.reader.cancel()


def _whole_path(app):
    """Ray's proxy gives an application its route prefix as the ASGI root_path; the app routes on the whole path
    (the same routes as the single server's)."""
    async def whole(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "root_path": ""}
        await app(scope, receive, send)

    return whole


def deploy_console(settings: ServeSettings, hub) -> None:
    deployment = serve.deployment(ConsoleEvents, name="Console", **console_options())
    serve.run(deployment.bind(for_replicas(settings), hub), name=CONSOLE_APP, route_prefix=EVENTS_ROUTE,
              blocking=False)


def stop_console(hub) -> None:
    """End every stream (they would hold the console's replica for its whole graceful timeout), then delete the
    console's application."""
    try:
        ray.get(hub.close.remote(), timeout=10)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        log.warning("the console's hub did not close: %s", exc)
    serve.delete(CONSOLE_APP)


def start_forwarding(hub, app, replica: str) -> asyncio.Task:
    """(an engine replica) Its step records to the hub while the console has viewers."""
    async def run() -> None:
        try:
            await forward(hub, app.state.server.events, replica)
        except ray.exceptions.TaskCancelledError:  # the replica is stopping (the call in flight was cancelled)
            pass
        except ray.exceptions.RayError as exc:  # the hub is gone (the server is stopping): keep serving
            log.warning("replica %s stops forwarding its steps to the console: %s", replica, exc)

    return asyncio.get_running_loop().create_task(run())
