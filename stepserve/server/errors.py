"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}, one exception type for all of them.

Every route raises APIError; the handlers installed here turn it (and Starlette's own 404/405, and anything
unexpected) into that shape, so a client never sees another error format.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..addons.errors import AddonBudgetError, AddonError, AddonTooLargeError

log = logging.getLogger("stepserve.server")


class APIError(Exception):
    """An error answer: HTTP status plus the OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def queue_full(message: str, retry_after_s: int) -> APIError:
    return APIError(429, f"{message} (retry after {retry_after_s} s)", type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(retry_after_s)})


def deadline_refused(message: str, retry_after_s: int) -> APIError:
    return APIError(429, f"{message}; refused now rather than answered late (retry after {retry_after_s} s, or "
                         f"raise timeout_s)", type="rate_limit_error", code="deadline_infeasible",
                    headers={"Retry-After": str(retry_after_s)})


def shutting_down(message: str = "the server is shutting down and accepts no new requests; retry on another "
                                  "replica or after it restarts") -> APIError:
    return APIError(503, message, type="service_unavailable", code="shutting_down")


def deadline_passed(timeout_s: float, what_happened: str | None = None) -> APIError:
    detail = f" ({what_happened})" if what_happened else ""
    return APIError(504, f"the request did not finish within its timeout of {timeout_s:g} s{detail}; raise "
                         f"timeout_s or retry when the server is less busy", type="timeout_error",
                    code="deadline_exceeded")


def engine_failed(detail: str) -> APIError:
    return APIError(503, f"{detail}; the server must be restarted", type="service_unavailable",
                    code="engine_failed")


def model_failure(detail: str | None) -> APIError:
    return APIError(500, f"the model failed on this request: {detail or 'unknown error'}", type="server_error",
                    code="model_failure")


def addon_failure(exc: AddonError) -> APIError:
    """A request that failed on one of its add-ons (a LoRA adapter, ControlNet or IP-Adapter: addons/errors.py): a
    memory held by the add-ons of requests in flight is 429 with Retry-After (they end within steps); anything else
    (too large, made for another model, ControlNets of different depths) is the request's own input, 400 naming
    its field."""
    if isinstance(exc, AddonBudgetError):
        return APIError(429, str(exc), type="rate_limit_error", param=exc.param, code="addon_memory_full",
                        headers={"Retry-After": str(exc.retry_after_s)})
    return APIError(400, str(exc), param=exc.param,
                    code="addon_too_large" if isinstance(exc, AddonTooLargeError) else "invalid_value")


def unsupported_media_type(got: str, also: str = "") -> APIError:
    shown = got[:60] or "none"
    also = f" {also}" if also else ""
    return APIError(415, f"the body must be JSON sent with 'Content-Type: application/json'{also}, got content "
                         f"type {shown!r}", code="unsupported_media_type")


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error", code="internal_error")


class UnexpectedErrors:
    """Pure ASGI middleware, inside the app's own middleware: an exception no handler took becomes the
    OpenAI-shaped 500 here (details in the log), so the middleware around it (ReplicaHeader, CORS) still sees the
    answer. Starlette's last-resort handler answers outside all middleware, which would drop their headers."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:  # noqa: BLE001 - the answer is a 500 and the log has the traceback
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if started:  # too late for an answer of our own
                raise
            await internal_error(exc).response()(scope, receive, send)


_STATUS_TEXT = {404: "not found", 405: "method not allowed"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/images/generations"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail or _STATUS_TEXT.get(exc.status_code, "error"))
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, message, type=kind, code=_STATUS_TEXT.get(exc.status_code, "http_error")
                        .replace(" ", "_")).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
        return invalid(f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid input')}",
                       loc[0] if loc else None).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return internal_error(exc).response()
