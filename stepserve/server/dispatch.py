"""The front of a server of several models: one ASGI app that sends each HTTP request to its model's app
(server/models.py) and answers what belongs to all of them itself.

Which model: a generation's, edit's or video's own "model" (the JSON body's, or the form field of an edit; none:
the default model); on every other route, the query parameter `?model=NAME` (none: the default model), except a
job's own routes (/v1/images/jobs/ID..., /v1/videos/ID...), which find the model whose app knows the job. The
console's stream of a model's steps (/v1/engine/events?model=NAME) neither loads nor pins its model: an open console
tab must not keep an idle model in device memory. Answered
here: the console's page (`/`, `/console/...`: console.page_app, so that opening it loads no model) and GET
/v1/models (every model with its family, where it is and what it serves), GET /v1/models/{id}, /health
(ok while every loaded model is healthy), /metrics (every loaded model's series with a `model` label, and the
device's turns and moves), and a 404 model_not_found for a model not served, after the API key check.

A request for a model on disk waits while it loads (its JSON body's timeout_s shortened by the wait, so the
deadline stays the caller's), or gets 429 with Retry-After at once when its deadline is shorter than the model's
last load took (models.py).
"""

from __future__ import annotations

import json
import math
import re
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .auth import require_key
from .console import page_app
from .errors import APIError
from .models import ModelEntry, ModelSet

BODY_ROUTES = ("/v1/images/generations", "/v1/images/edits", "/v1/videos")
JOB_ROUTE = re.compile(r"^/v1/(images/jobs|videos)/[^/]+")
EVENTS_ROUTE = "/v1/engine/events"
DEFAULT_BODY_LIMIT = 64 * 2**20


class Dispatch:
    """The ASGI app of a server of several models (see the module docstring)."""

    def __init__(self, models: ModelSet, api_key: str | None, default_timeout_s: float | None,
                 body_limit: int = DEFAULT_BODY_LIMIT) -> None:
        self.models = models
        self.check_key = require_key(api_key)
        self.default_timeout_s = default_timeout_s
        self.body_limit = body_limit
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
                return await self._health()(scope, receive, send)
            if path == "/" or path.startswith("/console/"):
                return await self.page(scope, receive, send)
            if path in ("/metrics", "/v1/models") or path.startswith("/v1/models/"):
                await self.check_key(Request(scope))
                answer = await self._metrics() if path == "/metrics" else self._cards(path)
                return await answer(scope, receive, send)
            if JOB_ROUTE.match(path) and "model" not in _query(scope):
                return await self._job(scope, receive, send)
            if path == EVENTS_ROUTE:
                return await self._events(scope, receive, send)
            body = None
            if path in BODY_ROUTES and scope["method"] == "POST":
                body = await _read(receive, self.body_limit)
                await self.check_key(Request(scope))
                name = await _body_model(scope, body)
            else:
                name = _query(scope).get("model")
                if name is not None:  # a wrong key hears 401, not which models are served
                    await self.check_key(Request(scope))
            entry = self.models.entry(name)
            await self._forward(entry, scope, receive, send, body)
        except APIError as exc:
            await exc.response()(scope, receive, send)

    async def _forward(self, entry: ModelEntry, scope, receive, send, body: bytes | None) -> None:
        entry.pending += 1  # pinned: never moved out of device memory while a request of its own is here
        try:
            if entry.stack is None:
                if self.draining:
                    raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
                self._refuse_if_late(entry, scope, body)
                waited = await self.models.ensure(entry)
                if body is not None and waited > 0:
                    body = _shorter_timeout(scope, body, waited, self.default_timeout_s)
            if body is not None:
                receive = _replay(body, receive)
            await entry.app(scope, receive, send)
        finally:
            entry.pending -= 1
            self.models.device.touch(entry.name)

    async def _events(self, scope, receive, send) -> None:
        """The console's stream of one model's steps: passed to its app as it is, not counted as the model's
        request (it would pin the model for as long as a tab stays open); a model on disk is not loaded for it."""
        name = _query(scope).get("model")
        if name is not None:
            await self.check_key(Request(scope))
        entry = self.models.entry(name)
        if entry.stack is None:
            raise APIError(409, f"model {entry.name} is not loaded: its steps stream once a request loads it "
                                f"(GET /v1/models says where each model is)", code="model_not_loaded", param="model")
        await entry.app(scope, receive, send)

    def _refuse_if_late(self, entry: ModelEntry, scope, body: bytes | None) -> None:
        """A request whose deadline is shorter than the model's last load: 429 at once, not a 504 after it."""
        if entry.last_load_s is None or body is None:
            return
        timeout = _json_field(scope, body, "timeout_s", self.default_timeout_s)
        if isinstance(timeout, (int, float)) and timeout < entry.last_load_s:
            retry = self.models.retry_after_s(entry)
            raise APIError(429, f"model {entry.name} is not loaded and loading it takes about {entry.last_load_s:.1f} "
                                f"s, longer than this request's timeout_s ({timeout:g}); retry after {retry} s or "
                                f"give a longer timeout_s", type="rate_limit_error", code="model_loading",
                           headers={"Retry-After": str(retry)})

    async def _job(self, scope, receive, send) -> None:
        """A job's own route: the first loaded model whose app does not answer 404 (jobs belong to one model)."""
        await self.check_key(Request(scope))
        loaded = [e for e in self.models.entries.values() if e.stack is not None]
        if not loaded:
            raise APIError(404, "no such job (no model is loaded)", code="not_found")
        for i, entry in enumerate(loaded):
            last = i == len(loaded) - 1
            probe = _Probe(send, pass_404=last)
            await entry.app(scope, receive, probe)
            if not probe.was_404 or last:
                return

    def _cards(self, path: str) -> Response:
        models = self.models
        if path == "/v1/models":
            cards = [models.card(e) for e in models.entries.values()]
            return JSONResponse({"object": "list", "data": cards})
        name = path[len("/v1/models/"):]
        entry = models.entry(name)
        return JSONResponse({**models.card(entry), "id": name})

    def _health(self) -> Response:
        loaded = [e for e in self.models.entries.values() if e.engine is not None]
        failed = [e.name for e in loaded if not e.engine.healthy]
        draining = any(e.app.state.server.draining for e in loaded if e.app is not None)
        status = "failed" if failed else "draining" if draining else "ok"
        body = {"status": status, "model": self.models.default, "models": {
            e.name: {"loaded": e.engine is not None, "queue_depth": e.engine.queue_depth if e.engine else 0,
                     "running": e.engine.running_count if e.engine else 0} for e in self.models.entries.values()}}
        if failed:
            body["reason"] = "engine_failed"
            body["failed"] = failed
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def _metrics(self) -> Response:
        from .model_metrics import render_all

        return Response(render_all(self.models), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
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


def _query(scope) -> dict[str, str]:
    raw = scope.get("query_string", b"").decode("latin-1")
    return {k: v[0] for k, v in parse_qs(raw).items()}


async def _read(receive, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise APIError(400, "the client went away while sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the body is larger than this server takes ({limit // 2**20} MiB)",
                           code="body_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, then=None):
    """A receive that gives the body already read, then passes on to the client's own `then` (which tells of a
    disconnect: the model's app watches for it while the request waits)."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive


def _content_type(scope) -> str:
    for key, value in scope.get("headers", []):
        if key == b"content-type":
            return value.decode("latin-1").split(";", 1)[0].strip().lower()
    return ""


def _json(scope, body: bytes):
    if _content_type(scope) != "application/json":
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None  # the model's app answers the 400
    return data if isinstance(data, dict) else None


def _json_field(scope, body: bytes, key: str, default=None):
    data = _json(scope, body)
    return default if data is None else data.get(key, default)


async def _body_model(scope, body: bytes) -> str | None:
    """The "model" a body names: a JSON body's field, or a form's (an edit's multipart upload)."""
    if _content_type(scope) == "multipart/form-data":
        request = Request(scope, _replay(body))
        try:
            async with request.form(max_files=64, max_fields=256) as form:
                value = form.get("model")
                return value if isinstance(value, str) else None
        except Exception:  # noqa: BLE001 - a malformed form: the default model's app answers its 400
            return None
    value = _json_field(scope, body, "model")
    return value if isinstance(value, str) or value is None else str(value)


def _shorter_timeout(scope, body: bytes, waited: float, default: float | None) -> bytes:
    """The JSON body with timeout_s less the time waited for the model to load (at least 1 ms left)."""
    data = _json(scope, body)
    if data is None:
        return body
    timeout = data.get("timeout_s", default)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout):
        return body
    data["timeout_s"] = max(0.001, float(timeout) - waited)
    return json.dumps(data).encode()
