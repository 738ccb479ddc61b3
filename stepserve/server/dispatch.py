"""The front of a server of several models: one ASGI app that sends each HTTP request to its model's app
(server/models.py) and answers what belongs to all of them itself.

Which model: a generation's, edit's or video's own "model" (the JSON body's, or the form field of an edit; none:
the default model); on every other route `?model=NAME` (none: the default model); a job's own routes
(/v1/images/jobs/ID..., /v1/videos/ID...) go to the model whose service the job belongs to in the state store. The
API key (one for all models) is checked before any body is read, any model loads or any 404 names what is served.
The console's stream of a model's steps (/v1/engine/events?model=NAME) neither loads nor pins its model: an open
console tab must not keep an idle model in device memory. Answered here: the console's page (`/`, `/console/...`:
open, and it loads no model), GET /v1/models and /v1/models/{id}, /health (its models' details only with the key),
/metrics (every loaded model's series with a `model` label, and the device's counters).

A request for a model on disk waits while it loads, at most its deadline (504 after it; its JSON body's timeout_s
shortened by the wait), or gets 429 with Retry-After at once when its deadline is shorter than the model's last
load took (models.py).
"""

from __future__ import annotations

import asyncio
import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .auth import require_key
from .console import page_app
from .errors import APIError
from .front_bodies import body_model, json_field, query, read, replay, shorter_timeout
from .models import ModelEntry, ModelSet

BODY_ROUTES = ("/v1/images/generations", "/v1/images/edits", "/v1/videos")
JOB_ROUTE = re.compile(r"^/v1/(images/jobs|videos)/([^/]+)")
EVENTS_ROUTE = "/v1/engine/events"
DEFAULT_BODY_LIMIT = 64 * 2**20


class Dispatch:
    """The ASGI app of a server of several models (see the module docstring)."""

    def __init__(self, models: ModelSet, api_key: str | None, default_timeout_s: float | None,
                 body_limit: int = DEFAULT_BODY_LIMIT) -> None:
        self.models = models
        self.check_key = require_key(api_key)
        self.default_timeout_s = default_timeout_s
        self.body_limit = body_limit  # the largest any model's app takes (a form, or JSON with controls' pictures)
        self.draining = False
        self.page = page_app()

    def start_drain(self) -> None:
        """SIGTERM: no model loads any more (a request for one on disk gets 503); the loaded ones drain."""
        self.draining = True

    def apps(self) -> list:
        return [e.app for e in self.models.entries.values() if e.app is not None and e.stack is not None]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # no websockets are served
            return
        path = scope["path"]
        try:
            if path == "/health":
                return await (await self._health(scope))(scope, receive, send)
            if path == "/" or path.startswith("/console/"):
                return await self.page(scope, receive, send)  # the page holds no secret: open, and no load
            if scope["method"] == "OPTIONS":
                return await self._open(scope, receive, send)  # a CORS preflight: a loaded model's app answers
            await self.check_key(Request(scope))  # the one key of every model: before any body, load or 404
            if path in ("/metrics", "/v1/models") or path.startswith("/v1/models/"):
                answer = await self._metrics() if path == "/metrics" else self._cards(path)
                return await answer(scope, receive, send)
            if not path.startswith("/v1/"):  # not the API (a browser's /favicon.ico): no model loads for it
                return await self._open(scope, receive, send)
            job = JOB_ROUTE.match(path)
            if job is not None and "model" not in query(scope):
                return await self._job(job.group(2), scope, receive, send)
            if path == EVENTS_ROUTE:
                return await self._events(scope, receive, send)
            body = None
            if path in BODY_ROUTES and scope["method"] == "POST":
                body = await read(scope, receive, self.body_limit)
                name = await body_model(scope, body)
            else:
                name = query(scope).get("model")
            await self._forward(self.models.entry(name), scope, receive, send, body)
        except APIError as exc:
            await exc.response()(scope, receive, send)

    async def _open(self, scope, receive, send) -> None:
        """A route any model's app answers alike (a CORS preflight): the model asked for, else the default, else
        any loaded one; none is loaded for it."""
        entries = self.models.entries
        named = entries.get(self.models.names.get(query(scope).get("model") or "", ""))
        for entry in (named, entries[self.models.default], *entries.values()):
            if entry is not None and entry.stack is not None:
                return await entry.app(scope, receive, send)
        if not scope["path"].startswith("/v1/"):
            raise APIError(404, "not found", code="not_found")
        raise APIError(503, "no model is loaded yet; send a request naming one", type="server_error",
                       code="no_model_loaded")

    async def _forward(self, entry: ModelEntry, scope, receive, send, body: bytes | None) -> None:
        entry.pending += 1  # pinned: never moved out of device memory while a request of its own is here
        try:
            if entry.stack is None:
                if self.draining:
                    raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
                timeout = json_field(scope, body, "timeout_s", self.default_timeout_s) if body else None
                timeout = timeout if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else None
                self._refuse_if_late(entry, timeout)
                try:
                    waited = await asyncio.wait_for(self.models.ensure(entry), timeout)
                except asyncio.TimeoutError:  # the load goes on for the next request
                    raise APIError(504, f"model {entry.name} did not load within this request's timeout_s "
                                        f"({timeout:g} s)", type="server_error", code="timeout") from None
                if body is not None and waited > 0:
                    body = shorter_timeout(scope, body, waited, self.default_timeout_s)
            if body is not None:
                receive = replay(body, receive)
            await entry.app(scope, receive, send)
        finally:
            entry.pending -= 1
            self.models.device.touch(entry.name)

    async def _events(self, scope, receive, send) -> None:
        """The console's stream of one model's steps: passed to its app as it is, not counted as the model's
        request (it would pin the model for as long as a tab stays open); a model on disk is not loaded for it."""
        entry = self.models.entry(query(scope).get("model"))
        if entry.stack is None:
            raise APIError(409, f"model {entry.name} is not loaded: its steps stream once a request loads it "
                                f"(GET /v1/models says where each model is)", code="model_not_loaded", param="model")
        await entry.app(scope, receive, send)

    def _refuse_if_late(self, entry: ModelEntry, timeout: float | None) -> None:
        """A request whose deadline is shorter than the model's last load: 429 at once, not a 504 after it."""
        if entry.last_load_s is None or timeout is None:
            return
        if timeout < entry.last_load_s:
            retry = self.models.retry_after_s(entry)
            raise APIError(429, f"model {entry.name} is not loaded and loading it takes about {entry.last_load_s:.1f} "
                                f"s, longer than this request's timeout_s ({timeout:g}); retry after {retry} s or "
                                f"give a longer timeout_s", type="rate_limit_error", code="model_loading",
                           headers={"Retry-After": str(retry)})

    async def _job(self, job_id: str, scope, receive, send) -> None:
        """A job's own route: the model whose service the job belongs to (jobs belong to one model), loaded for it
        if it went to disk; a job of no model known here: the first loaded model's answer (its 404)."""
        record = await asyncio.to_thread(self.models.store.get_job, job_id) if self.models.store else None
        owner = next((e for e in self.models.entries.values()
                      if record is not None and e.service is not None and e.service == record.service), None)
        if owner is None:
            owner = next((e for e in self.models.entries.values() if e.stack is not None), None)
            if owner is None:
                raise APIError(404, f"no job {job_id[:100]!r} here", code="not_found")
        await self._forward(owner, scope, receive, send, None)

    def _cards(self, path: str) -> Response:
        models = self.models
        if path == "/v1/models":
            cards = [models.card(e) for e in models.entries.values()]
            return JSONResponse({"object": "list", "data": cards})
        name = path[len("/v1/models/"):]
        entry = models.entry(name)
        return JSONResponse({**models.card(entry), "id": name})

    async def _health(self, scope) -> Response:
        """Open, as one model's: the status; each model's details only to a caller with the key (or no key set)."""
        try:
            await self.check_key(Request(scope))
            detailed = True
        except APIError:
            detailed = False
        loaded = [e for e in self.models.entries.values() if e.engine is not None]
        failed = [e.name for e in loaded if not e.engine.healthy]
        draining = any(e.app.state.server.draining for e in loaded if e.app is not None)
        status = "failed" if failed else "draining" if draining else "ok"
        body = {"status": status, "model": self.models.default}
        if detailed:
            body["models"] = {e.name: {"loaded": e.engine is not None, "queue_depth": e.engine.queue_depth if e.engine
                                       else 0, "running": e.engine.running_count if e.engine else 0}
                              for e in self.models.entries.values()}
        if failed:
            body["reason"] = "engine_failed"
            if detailed:
                body["failed"] = failed
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def _metrics(self) -> Response:
        from .model_metrics import render_all

        return Response(render_all(self.models), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.models.loop = asyncio.get_running_loop()  # models sent to disk are dropped on it
                try:
                    for entry in self.models.entries.values():
                        if entry.app is not None and entry.stack is None:
                            await self.models.start(entry)
                except Exception as exc:  # noqa: BLE001 - uvicorn prints it and exits
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.models.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


class _Probe:
    """A send that swallows a 404 answer (unless `pass_404`), so the next model's app can be asked."""

    def __init__(self, send, pass_404: bool) -> None:
        self.send, self.pass_404, self.was_404 = send, pass_404, False

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 404 and not self.pass_404:
            self.was_404 = True
        if not self.was_404:
            await self.send(message)
