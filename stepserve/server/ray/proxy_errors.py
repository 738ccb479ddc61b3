"""Ray Serve's own HTTP errors in the OpenAI error shape, so a client of the replicas sees one error format.

The replicas already answer in that shape (they run the same app as `stepserve serve`). What Ray's proxy says on
its own is plain text: 429 when its queue is full (max_queued_requests), 503 when no replica can take a request,
408 on its request timeout, 404 for a route no application holds, and a bare 500 when the replica serving a request
died before answering. This ASGI middleware runs in the proxy and rewrites just those answers (status and
Retry-After kept). Ray loads it from the import path in RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, which must be
set where the cluster starts: `stepserve serve --replicas` sets it for the local cluster it starts; for a cluster
of your own, start it with PROXY_CALLBACK_ENV=PROXY_CALLBACK (docs/SCALING.md).
"""

from __future__ import annotations

import json

from ..replica_header import REPLICA_HEADER
from ..errors import APIError

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "stepserve.server.ray.proxy_errors.proxy_middlewares"

_REPLICA = REPLICA_HEADER.lower().encode()
_KINDS = {  # status -> (type, code, what it means for the client)
    404: ("invalid_request_error", "not_found", "no application serves this path on the Ray Serve proxy"),
    408: ("timeout_error", "request_timeout", "Ray Serve's request timeout passed before a replica answered"),
    429: ("rate_limit_error", "queue_full",
          "every replica is at max_ongoing_requests and Ray Serve's queue (max_queued_requests) is full"),
    500: ("server_error", "replica_failed",
          "the replica serving this request failed before answering (it may have died); the others still serve"),
    503: ("service_unavailable", "no_replica", "no replica can take this request now"),
}


def proxy_middlewares() -> list:
    from starlette.middleware import Middleware

    return [Middleware(OpenAIErrorsFromRay)]


def shaped(status: int, ray_text: str, retry_after: str | None) -> APIError:
    kind, code, meaning = _KINDS[status]
    detail = f" (Ray Serve: {ray_text.strip()})" if ray_text.strip() else ""
    retry = f"; retry after {retry_after} s" if retry_after else "; retry"
    headers = {"Retry-After": retry_after} if retry_after else None
    return APIError(status, f"{meaning}{detail}{retry}", type=kind, code=code, headers=headers)


class OpenAIErrorsFromRay:
    """Pure ASGI: answers that come from a replica (they carry X-Stepserve-Replica) and streams pass through."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict | None = None  # the start of a Ray-made error, held until its body has arrived
        body = b""
        started = False

        async def send_shaped(message) -> None:
            nonlocal held, body, started
            if message["type"] == "http.response.start":
                started = True
                headers = dict(message.get("headers", ()))
                if message["status"] in _KINDS and _REPLICA not in headers:
                    held = message
                    return
            elif held is not None and message["type"] == "http.response.body":
                body += message.get("body", b"")
                if not message.get("more_body", False):
                    retry = dict(held.get("headers", ())).get(b"retry-after")
                    await _send(send, shaped(held["status"], _text(body), retry.decode() if retry else None))
                return
            await send(message)

        try:
            await self.app(scope, receive, send_shaped)
        except Exception:
            if started:
                raise
            await _send(send, shaped(500, "", None))
            return
        if not started:  # the proxy gave up without an answer (uvicorn would send a bare 500)
            await _send(send, shaped(500, "", None))


def _text(body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    try:  # Ray sometimes sends a JSON-encoded string
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


async def _send(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
