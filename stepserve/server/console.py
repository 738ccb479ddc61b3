"""The web console: `GET /` serves a page (HTML, CSS and JS in stepserve/server/console/, no build step, nothing
from a CDN) with a playground and a live view of the batch; `GET /v1/engine/events` feeds that view (events.py).

The page itself holds no secret and is served without a key. When the server has an API key, the page asks for it
and sends it in the Authorization header of its API calls, as any client does; it is kept in the page's memory
only, never in storage or the URL.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from .events import EngineEvents
from .streaming import EventStreamResponse

ASSETS = {"index.html": "text/html; charset=utf-8", "console.css": "text/css; charset=utf-8",
          "console.js": "text/javascript; charset=utf-8"}


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


def event_routes(events: EngineEvents) -> APIRouter:
    """`/engine/events` under /v1, behind the API key like the rest of /v1."""
    router = APIRouter()

    @router.get("/engine/events")
    async def engine_events() -> Response:
        queue = events.subscribe()
        return EventStreamResponse(events.chunks(queue), lambda: events.unsubscribe(queue))

    return router
