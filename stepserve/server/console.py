"""The web console: `GET /` serves a page (HTML, CSS and JS in stepserve/server/console/, no build step, nothing
from a CDN) with a playground and a live view of the batch; `GET /v1/engine/events` feeds that view (events.py).

Under Ray Serve the stream is served apart from the engine replicas: events_app() is the whole app of a light
deployment of its own (ray/console.py), fed by every replica through a hub (ray/fleet_events.py), so that open
streams hold none of the replicas' request slots.

On a server of several models (server/dispatch.py) the front serves the page itself (page_app: opening it loads no
model and holds none), and the page opens one stream per model loaded, `/v1/engine/events?model=NAME`, which the
front passes to that model's app without holding the model in device memory: one lane group per model, and a strip
of which model held the device at each step.

The page itself holds no secret and is served without a key. When the server has an API key, the page asks for it
and sends it in the Authorization header of its API calls, as any client does; it is kept in the page's memory
only, never in storage or the URL.
"""

from __future__ import annotations

from importlib import resources
from typing import Protocol

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import Response

from .auth import require_key
from .errors import install_error_handlers
from .replica_header import REPLICA_HEADER, ReplicaHeader
from .streaming import EventStreamResponse


class StreamSource(Protocol):
    """What feeds /v1/engine/events: this process's engine (events.EngineEvents) or the fleet's hub
    (ray/fleet_events.FleetEvents)."""

    def subscribe(self): ...  # a queue for a new viewer; APIError 429 past the viewer cap

    def unsubscribe(self, queue) -> None: ...

    def chunks(self, queue): ...  # the viewer's SSE body

ASSETS = {"index.html": "text/html; charset=utf-8", "console.css": "text/css; charset=utf-8",
          "console.js": "text/javascript; charset=utf-8", "lanes.js": "text/javascript; charset=utf-8",
          "models.js": "text/javascript; charset=utf-8"}


def _asset(name: str) -> Response:
    body = resources.files(__package__).joinpath("console", name).read_bytes()
    return Response(body, media_type=ASSETS[name], headers={"cache-control": "no-cache"})


def page_routes() -> APIRouter:
    """The page and its files: open, like /health."""
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def index() -> Response:
        return _asset("index.html")

    @router.get("/console/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return Response(f"no such console file: {name}", status_code=404, media_type="text/plain")
        return _asset(name)

    return router


def page_app() -> FastAPI:
    """The page and its files as an app of their own: what the front of several models answers for `/` and
    `/console/...` (no model's app is asked, so none loads for it)."""
    app = FastAPI(title="stepserve console", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(page_routes())
    return app


def event_routes(events: StreamSource) -> APIRouter:
    """`/engine/events` under /v1, behind the API key like the rest of /v1."""
    router = APIRouter()

    @router.get("/engine/events")
    async def engine_events() -> Response:
        queue = events.subscribe()
        return EventStreamResponse(events.chunks(queue), lambda: events.unsubscribe(queue))

    return router


def events_app(events: StreamSource, api_key: str | None, cors_origins: tuple[str, ...] = (),
               name: str | None = None) -> FastAPI:
    """An app that serves /v1/engine/events alone, behind the key, errors in the OpenAI shape. `name` goes in
    X-Stepserve-Replica on every answer (so Ray's proxy passes its 429s through as the app's own)."""

    app = FastAPI(title="stepserve console events", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.include_router(event_routes(events), prefix="/v1", dependencies=[Depends(require_key(api_key))])
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET"],
                           allow_headers=["Authorization"], expose_headers=[REPLICA_HEADER])
    if name is not None:
        app.add_middleware(ReplicaHeader, replica=name)
    return app
