"""The FastAPI app: OpenAI-compatible image generation over an AsyncEngine (and video generation for a video model:
videos.py), plus models, health and metrics.

create_app() takes an engine that has not been started; the app starts it when the server starts and shuts it
down (letting in-flight work finish within the grace period) when the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from ..engine.async_engine import AsyncEngine
from ..fleet.headers import WORK_HEADERS
from ..store.base import DEFAULT_MAX_ATTEMPTS, Store
from ..store.memory import MemoryStore
from ..store.results import Results
from .auth import require_key
from .hosts import HostCheck, ServedHosts
from .replica_header import REPLICA_HEADER, ReplicaHeader  # noqa: F401 (REPLICA_HEADER: part of the app's API)
from .bodies import JSON, check_json
from .errors import APIError, UnexpectedErrors, install_error_handlers
from .images import backstop_s, check, image_body, outcome_of, submit_all, wait_all
from .state import CLIENT_GONE, ServerState
from .console import event_routes, page_routes
from .edits import read_edit
from .events import EngineEvents
from .lora_registry import AdapterRegistry
from .loras import lora_routes
from .controlnets import controlnet_routes, read_generation, with_controls
from .ip_adapters import ip_adapter_routes
from .metrics import CONTENT_TYPE, ServerMetrics
from .schemas import ImageGenerationRequest, ServerLimits, check_model, engine_params, served_names, serves
from .streaming import EventStreamResponse, StreamJob, image_events
from .image_jobs import async_answer, image_job_routes
from .jobs_app import attach_jobs
from .videos import video_routes

log = logging.getLogger("stepserve.server")


MetricsView = Callable[[ServerMetrics], Awaitable[bytes]]


def create_app(engine: AsyncEngine, api_key: str | None = None, limits: ServerLimits | None = None,
               shutdown_grace_s: float = 30.0, replica: str | None = None,
               metrics_view: MetricsView | None = None, cors_origins: tuple[str, ...] | list[str] = (),
               access_log: bool = True, store: Store | None = None, results: Results | None = None,
               owner: str | None = None, webhook_secret: str | None = None, job_lease_s: float = 30.0,
               job_poll_s: float = 1.0, service: str | None = None,
               job_max_attempts: int = DEFAULT_MAX_ATTEMPTS, webhook_allow: tuple[str, ...] = (),
               listen_host: str | None = None, allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """The one app both servers run: `stepserve serve` hosts it alone, and each Ray Serve replica hosts its own
    (stepserve/server/ray/deployment.py). A replica passes its id (every response then carries X-Stepserve-Replica) and
    a metrics_view that renders all replicas' metrics instead of this app's alone. cors_origins: the web origins
    whose pages may call the API from a browser (none by default). access_log: one line per image or video request
    on the "stepserve.access" logger (ServerState.request_done, video_done). Jobs (videos, async images) live in
    `store` with their files in `results` (by default an in-memory store and a temporary folder, closed with the
    app: `stepserve serve` passes the ones its flags name); `owner` is this process's id in the store (a stable one
    lets a restarted server take back its jobs at once; default: a new one). The same store holds the LoRA
    adapters registered at run time, shared by the replicas. Jobs and registrations belong to `service` (default:
    derived from what the engine serves, server/jobs_app.py); a job claimed job_max_attempts times ends failed.
    webhook_allow: internal receivers webhooks may reach (jobs/targets.py). listen_host: the address the server
    listens on; without an API key, only its Host names and `allowed_hosts` are answered (server/hosts.py); None (an
    app whose host checks nothing of its own): no Host check."""
    state = ServerState(engine, limits or ServerLimits(), ServerMetrics(engine), api_key or None,
                        cors_origins=tuple(cors_origins), access_log=access_log)
    engine.on_step.append(state.metrics.on_step)
    events = EngineEvents(engine)
    state.events = events  # start_drain ends its streams
    store = store if store is not None else MemoryStore()
    jobs = attach_jobs(state, store, results, owner, webhook_secret, job_lease_s, job_poll_s, service,
                       job_max_attempts, webhook_allow)
    registry = AdapterRegistry(engine, store, replica, service=jobs.service)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        registry.start()
        jobs.start()
        try:
            yield
        finally:
            jobs.stop_claiming()
            events.close()  # open event streams end with the app (a model going back to disk included)
            await registry.close()
            await engine.shutdown(shutdown_grace_s)
            await jobs.close()

    app = FastAPI(title="stepserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.lora_registry = registry
    install_error_handlers(app)
    protected = [Depends(_auth(state))]
    app.include_router(_open_routes(state))
    app.include_router(page_routes())
    app.include_router(_v1_routes(state), prefix="/v1", dependencies=protected)
    app.include_router(event_routes(events), prefix="/v1", dependencies=protected)
    app.include_router(lora_routes(state, registry), prefix="/v1", dependencies=protected)
    app.include_router(controlnet_routes(state), prefix="/v1", dependencies=protected)
    app.include_router(ip_adapter_routes(state), prefix="/v1", dependencies=protected)
    app.include_router(video_routes(state), prefix="/v1", dependencies=protected)
    app.include_router(image_job_routes(state), prefix="/v1", dependencies=protected)
    app.include_router(_metrics_route(state, metrics_view), dependencies=protected)
    app.include_router(_schema_route(app), dependencies=protected)
    app.add_middleware(UnexpectedErrors)  # innermost: its 500 passes the middleware below on the way out
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "Prefer", *WORK_HEADERS],
                           expose_headers=[REPLICA_HEADER, "Location", "Preference-Applied"])
    if replica is not None:
        app.add_middleware(ReplicaHeader, replica=replica)
    if listen_host is not None and not state.api_key:  # outermost: a rebound page is refused before anything
        app.add_middleware(HostCheck, hosts=ServedHosts.of(listen_host, allowed_hosts))
    return app


def start_drain(app: FastAPI) -> None:
    """Stop accepting image requests (they get 503); work already accepted carries on."""
    state: ServerState = app.state.server
    state.draining = True
    state.engine.accepting = False
    state.jobs.stop_claiming()  # the jobs running here finish within the grace period, or are handed back
    if state.events is not None:  # the console's event streams never end by themselves
        state.events.close()


def is_idle(app: FastAPI) -> bool:
    state: ServerState = app.state.server
    return (state.inflight == 0 and state.engine.queue_depth == 0 and state.engine.running_count == 0
            and not state.jobs.busy)


def _auth(state: ServerState):
    return require_key(state.api_key, lambda request: _count_refusal(state, request))


def _count_refusal(state: ServerState, request: Request) -> None:
    """An image request (generations, edits) or a video's creation refused for its key counts as one of those; a
    scrape, a look-up or an event stream has its own counter."""
    path, now = request.url.path, time.monotonic()
    if path.endswith(("/images/generations", "/images/edits")):
        state.request_done("unauthorized", 401, now, path=path)
    elif path.endswith("/v1/videos") and request.method == "POST":
        state.video_done("unauthorized", 401, now)
    else:
        state.metrics.unauthorized.labels(
            "metrics" if path == "/metrics" else "openapi" if path == "/openapi.json" else "loras" if "/loras" in path
            else "videos" if "/videos" in path else "jobs" if "/images/jobs" in path else "events" if "/events" in path
            else "models").inc()


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()
    logged: list[bool] = []  # the engine's failure is logged once

    @router.get("/health")
    async def health() -> JSONResponse:
        engine = state.engine
        status = "failed" if not engine.healthy else "draining" if state.draining else "ok"
        body = {"status": status, "model": engine.model_info.name, "queue_depth": engine.queue_depth,
                "running": engine.running_count}
        if not engine.healthy:  # the details are in the log, not in an answer anyone may read
            body["reason"] = "engine_failed"
            if not logged:
                logged.append(True)
                log.error("health: the engine failed: %s", engine.failure)
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    return router


def _metrics_route(state: ServerState, view: MetricsView | None) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render() if view is None else await view(state.metrics)
        return Response(body, media_type=CONTENT_TYPE)

    return router


def _schema_route(app: FastAPI) -> APIRouter:
    router = APIRouter()

    @router.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    return router


_BODY_SCHEMA = {"requestBody": {"required": True, "content": {JSON: {"schema": {
    **ImageGenerationRequest.model_json_schema(), "additionalProperties": False}}}}}


def _model_card(state: ServerState, name: str) -> dict:
    """OpenAI's model object, then what a server of several models shows too (models.py): family, place, serves."""
    info = state.engine.model_info
    return {"id": name, "object": "model", "created": state.started_at, "owned_by": "stepserve",
            "family": info.family, "place": "device", "serves": serves(info)}


def _v1_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/models")
    async def models() -> dict:  # the model's own name first, then its --served-model-name aliases
        names = served_names(state.engine.model_info.name, state.limits)
        return {"object": "list", "data": [_model_card(state, name) for name in names]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id, state.engine.model_info.name, state.limits)
        return _model_card(state, model_id)

    @router.post("/images/generations", openapi_extra=_BODY_SCHEMA)
    async def generate(request: Request) -> Response:
        async def read():
            check_json(request)
            req = await read_generation(request, state)  # its controls' pictures decoded below (controlnets.py)
            return req, await with_controls(req, engine_params(req, state.limits), state), None

        return await answer(state, request, read)

    @router.post("/images/edits")
    async def edit(request: Request) -> Response:
        return await answer(state, request, lambda: read_edit(request, state))

    return router


async def answer(state: ServerState, request: Request, read) -> Response:
    """One images request, generations or edits: `read()` -> (the body, its SamplingParams per image, an edit's
    form as sent); then admission, the wait (or the event stream) and the answer, with the request's bookkeeping.
    With `Prefer: respond-async`: a job instead (image_jobs.py); a synchronous request never touches the store."""
    started, path = time.monotonic(), request.url.path
    state.inflight += 1
    streaming = False
    try:
        req, params, sent = await read()
        check_model(req.model, state.engine.model_info.name, state.limits)  # 404 for a model not served here
        created = await async_answer(state, request, path, req, params, sent)
        if created is not None:  # Prefer: respond-async
            return created
        handles = await submit_all(state, params, (req.partial_images or 0) if req.stream else 0, stream=req.stream)
        if req.stream:
            job = StreamJob(state, handles, started, path)
            streaming = True  # from here the stream owns the bookkeeping
            return EventStreamResponse(image_events(job, backstop_s(params)), job.close)
        results = await wait_all(state, handles, request.receive, backstop_s(params))
        if results is None:
            state.request_done("cancelled", CLIENT_GONE, started, path=path)
            return Response(status_code=CLIENT_GONE)
        for r in results:
            check(r)
        body = await image_body(state, results)
        for r in results:
            state.note_latency(r.timing.total_s or 0.0)
        state.request_done("completed", 200, started, results, path)
        return JSONResponse(body)
    except APIError as exc:
        state.request_done(outcome_of(exc), exc.status, started, path=path)
        return exc.response()
    except ClientDisconnect:
        state.request_done("cancelled", CLIENT_GONE, started, path=path)
        return Response(status_code=CLIENT_GONE)
    except asyncio.CancelledError:  # the handler cancelled (Ray Serve when the client goes away): its requests
        state.request_done("cancelled", CLIENT_GONE, started, path=path)  # are aborted by the engine or wait_all
        raise
    except Exception:  # answered 500 by the app's last resort (errors.UnexpectedErrors); counted here all the same
        state.request_done("failed", 500, started, path=path)
        raise
    finally:
        if not streaming:
            state.inflight -= 1
