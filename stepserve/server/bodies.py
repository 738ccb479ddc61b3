"""Reading a POST body, the one home for it: declared JSON and no larger than the server's limit (read_body), the
bytes counted as they arrive (counted: the multipart form reader, forms.py, streams through it too), and the strict,
total parse of a JSON object into a route's pydantic model (parse_object, from_fields): any body either becomes the
model or an APIError 400 naming the field and what is allowed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from . import errors
from .errors import APIError, invalid

JSON = "application/json"
Model = TypeVar("Model", bound=BaseModel)


def check_json(request: Request, also: str = "") -> None:
    """A POST body must be declared JSON: a web page cannot send that cross-origin without a CORS preflight, which
    only --cors-origin lets pass. `also`: what else the route takes, for the 415's message."""
    declared = request.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != JSON:
        raise errors.unsupported_media_type(declared, also)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to be over `limit` bytes (declared or streamed): unread,
    so the field at fault is unknown (json_too_large names it where the body was read)."""
    return b"".join([chunk async for chunk in counted(request, limit, TEXT_ADVICE)])


TEXT_ADVICE = "a JSON body carries text only: shorten its text fields (prompt, negative_prompt)"


async def json_too_large(raw: bytes, limit: int) -> APIError:
    """The 413 of a JSON body read whole and found over `limit`: it names the field that makes it so (the longest
    of the object's values, "negative_prompt is 10485760 characters"), parsed off the event loop; a body that does
    not parse gets the general advice."""
    largest = await asyncio.to_thread(_largest_field, raw)
    if largest is None:
        return too_large(limit, TEXT_ADVICE)
    name, size = largest
    return too_large(limit, f"its field {name} is {size} characters; shorten it", param=name)


def _largest_field(raw: bytes) -> tuple[str, int] | None:
    try:
        data = json_value(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or not data:
        return None
    sizes = {str(k)[:40]: len(v) if isinstance(v, str) else len(json.dumps(v)) for k, v in data.items()}
    name = max(sizes, key=sizes.__getitem__)
    return name, sizes[name]


async def counted(request: Request, limit: int, advice: str) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive: a 413 before any is read when its declared length (Content-Length) is
    over `limit`, else as soon as the bytes read pass it; the rest is never read. A client gone raises Starlette's
    ClientDisconnect."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit, advice)
    size = 0
    async with aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > limit:
                raise too_large(limit, advice)
            yield chunk


def too_large(limit: int, advice: str, param: str | None = None) -> APIError:
    shown = f"{limit // 2**20} MiB" if limit >= 2**20 else f"{limit // 1024} KiB"
    return APIError(413, f"the request body is larger than {shown}; {advice}", code="body_too_large", param=param)


def json_value(text: str | bytes) -> Any:
    """Strict JSON: NaN and Infinity refused, and a value nested too deeply for the parser is a ValueError too."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_object(raw: bytes, model: type[Model], example: str) -> Model:
    """A JSON object of `model`'s fields (extra fields forbidden by its config), or a 400 naming what is wrong;
    `example` is a body to show when it is not a JSON object at all."""
    try:
        data = json_value(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid(f"the body is not valid JSON ({exc}); send a JSON object such as {example}",
                      code="invalid_json") from None
    if not isinstance(data, dict):
        raise invalid(f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return from_fields(data, model)


def from_fields(data: dict, model: type[Model]) -> Model:
    """`model` from a dict of fields (a parsed JSON body or a form's), or a 400 naming the first wrong field."""
    try:
        return model.model_validate(data)
    except PydanticValidationError as exc:
        raise _from_pydantic(exc, tuple(model.model_fields)) from None


def _from_pydantic(exc: PydanticValidationError, fields: tuple[str, ...]) -> APIError:
    first = exc.errors(include_url=False)[0]
    field = str(first["loc"][0]) if first.get("loc") else None
    if first["type"] == "extra_forbidden":
        return invalid(f"unknown field {field!r}; allowed fields: {', '.join(fields)}", field, "unknown_field")
    if first["type"] == "missing":
        return invalid(f"{field} is required", field, "missing_field")
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return invalid(f"{field}: {first['msg'].lower()}, got {shown}", field, "invalid_type")
