"""The API key check, one copy for every app that serves /v1: the engine's (app.py) and, under Ray Serve, the
console's stream (ray/console.py)."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request

from . import errors


def require_key(api_key: str | None, on_refusal: Callable[[Request], None] | None = None):
    """A FastAPI dependency: without `api_key` every request passes; with one, a request must send
    `Authorization: Bearer <key>` or gets 401 (`on_refusal(request)` is told first, for the metrics)."""
    expected = None if api_key is None else api_key.encode()

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            if on_refusal is not None:
                on_refusal(request)
            raise errors.unauthorized("missing API key; send the header 'Authorization: Bearer <key>'")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            if on_refusal is not None:
                on_refusal(request)
            raise errors.unauthorized("invalid API key; send the header 'Authorization: Bearer <key>' with the "
                                      "key the server was started with")

    return check
