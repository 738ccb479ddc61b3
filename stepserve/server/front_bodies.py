"""What the front of a server of several models (dispatch.py) reads of a request before its model's app reads it
all: the query, the body (bounded, then replayed to the app), and the fields that choose the model and bound its
load (a JSON body's, parsed as the apps parse it; an edit's form field)."""

from __future__ import annotations

import asyncio
import json
import math
from urllib.parse import parse_qs

from starlette.requests import Request

from .bodies import json_value
from .errors import APIError

ON_LOOP_BYTES = 64 * 2**10  # a JSON body larger than this is parsed off the event loop


def query(scope) -> dict[str, str]:
    raw = scope.get("query_string", b"").decode("latin-1")
    return {k: v[0] for k, v in parse_qs(raw).items()}


async def read(scope, receive, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to be over `limit` (declared or streamed)."""
    declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), b"")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body is larger than this server takes ({limit // 2**20} MiB)", code="body_too_large")
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


def replay(body: bytes, then=None):
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


def content_type(scope) -> str:
    for key, value in scope.get("headers", []):
        if key == b"content-type":
            return value.decode("latin-1").split(";", 1)[0].strip().lower()
    return ""


def json_object(scope, body: bytes | None) -> dict | None:
    """A JSON body's object, parsed as the models' apps parse it (bodies.json_value); None otherwise (the app
    answers the 400)."""
    if body is None or content_type(scope) != "application/json":
        return None
    try:
        data = json_value(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def json_field(scope, body: bytes, key: str, default=None):
    data = json_object(scope, body)
    return default if data is None else data.get(key, default)


async def body_model(scope, body: bytes) -> str | None:
    """The "model" a body names: a JSON body's field, or a form's (an edit's multipart upload)."""
    if content_type(scope) == "multipart/form-data":
        request = Request(scope, replay(body))
        try:
            async with request.form(max_files=64, max_fields=256) as form:
                value = form.get("model")
                return value if isinstance(value, str) else None
        except Exception:  # noqa: BLE001 - a malformed form: the default model's app answers its 400
            return None
    if len(body) > ON_LOOP_BYTES:  # a JSON body with pictures (controls): parsed on a worker thread
        return (await asyncio.to_thread(json_object, scope, body) or {}).get("model")
    return (json_object(scope, body) or {}).get("model")  # not a string: entry() answers the 400


def shorter_timeout(scope, body: bytes, waited: float, default: float | None) -> bytes:
    """The JSON body with timeout_s less the time waited for the model to load (at least 1 ms left)."""
    data = json_object(scope, body)
    if data is None:
        return body
    timeout = data.get("timeout_s", default)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout):
        return body
    data["timeout_s"] = max(0.001, float(timeout) - waited)
    return json.dumps(data).encode()
