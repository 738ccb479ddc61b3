"""Reading a POST body, as every JSON route does: declared JSON, and no larger than the server's limit."""

from __future__ import annotations

from fastapi import Request

from . import errors
from .errors import APIError

JSON = "application/json"


def check_json(request: Request) -> None:
    """A POST body must be declared JSON: a web page cannot send that cross-origin without a CORS preflight, which
    only --cors-origin lets pass."""
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != JSON:
        raise errors.unsupported_media_type(declared)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to be over `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit // 1024} KiB; shorten the prompt",
                    code="body_too_large")
