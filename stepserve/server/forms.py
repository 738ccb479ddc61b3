"""Reading a multipart/form-data body, the one home for it: POST /v1/images/edits, and POST /v1/videos as the
official clients send it.

The whole body is bounded (ServerLimits.max_upload_bytes): a declared length (Content-Length) over the limit is a
413 before any of it is read, and the bytes are counted as they arrive (bodies.counted), so a chunked body is
refused as soon as the count passes the limit and the rest is never read. Text fields are small (at most
ServerLimits.max_body_bytes each, as a JSON body), files at most MAX_FILE_BYTES each, and the counts of fields and
files are bounded. A malformed form is a 400 that says what is allowed; a client gone while it is read raises
Starlette's ClientDisconnect, which the routes record as cancelled.

A form post is what a web page can send to any site without a CORS preflight, so on a server without an API key a
form is taken only from the server's own pages or an origin allowed with --cors-origin (check_origin).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from fastapi import Request
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from .bodies import counted, json_value
from .errors import APIError, invalid

if TYPE_CHECKING:
    from .state import ServerState

FORM = "multipart/form-data"
MAX_FILE_BYTES = 16 * 2**20  # one uploaded file (an edit's image or mask)
MAX_FIELDS = 64  # text fields in one form


def is_form(request: Request) -> bool:
    return _kind(request) == FORM


@asynccontextmanager
async def bounded_form(request: Request, state: ServerState, max_files: int) -> AsyncIterator[FormData]:
    """The request's multipart form, read within the server's limits (see the module's doc); its files are closed
    when the block ends."""
    check_origin(request, state)
    if not is_form(request):
        raise APIError(415, f"the body must be sent as multipart/form-data, got {_kind(request) or 'no content type'!r}",
                       code="unsupported_media_type")
    limits = state.limits
    text_kib = limits.max_body_bytes // 1024
    advice = f"allowed: files of at most {MAX_FILE_BYTES // 2**20} MiB each and text fields of at most {text_kib} KiB"
    async with aclosing(counted(request, limits.max_upload_bytes, advice)) as chunks:
        parser = MultiPartParser(request.headers, chunks, max_files=max_files, max_fields=MAX_FIELDS,
                                 max_part_size=limits.max_body_bytes)
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            raise invalid(f"the form could not be read: {exc.message}; allowed: at most {max_files} files and "
                          f"{MAX_FIELDS} text fields, each text field at most {text_kib} KiB") from None
    try:
        yield form
    finally:
        await form.close()


def form_fields(form: FormData, text: Iterable[str], skip: Iterable[str], files: str) -> dict:
    """The form's fields as a body's: those in `text` as they are, every other one read as JSON (numbers,
    true/false, objects); `skip` (the files a route reads itself) left out. A file where a field belongs, a field
    given twice or a value that is not JSON is a 400 naming it; `files` says which files the route takes."""
    text, skip = set(text), set(skip)
    fields: dict = {}
    for key, value in form.multi_items():
        if key in skip:
            continue
        if isinstance(value, UploadFile):
            raise invalid(f"{key}: a file where a form field is expected; files taken: {files}", key)
        if key in fields:
            raise invalid(f"{key}: given more than once; send each field once", key)
        if key in text:
            fields[key] = value
            continue
        try:
            fields[key] = json_value(value)
        except ValueError as exc:
            raise invalid(f"{key}: {value[:40]!r} is not a JSON value ({exc}); send numbers and true/false as text, "
                          f"objects and lists as JSON", key) from None
    return fields


def check_origin(request: Request, state: ServerState) -> None:
    """On a server without an API key, refuse a browser's form post from another site: an Origin that is neither
    the server's own (its Host) nor one allowed with --cors-origin, or, with no Origin, `Sec-Fetch-Site:
    cross-site`. With a key the route's key check stands guard: a page cannot send the key cross-origin without a
    preflight."""
    if state.api_key is not None:
        return
    origin = request.headers.get("origin")
    if origin is None:
        if request.headers.get("sec-fetch-site", "").lower() == "cross-site":
            raise _cross_site("another site")
        return
    if origin in state.cors_origins or _host_of(origin) == request.headers.get("host", "").lower():
        return
    raise _cross_site(repr(origin[:80]))


def _host_of(origin: str) -> str | None:
    try:
        return urlsplit(origin).netloc.lower() or None
    except ValueError:
        return None


def _cross_site(who: str) -> APIError:
    return APIError(403, f"a form sent from a web page of {who} is refused: this server has no API key, so it takes "
                         f"forms only from its own pages; start it with --api-key (and send the key), or allow that "
                         f"page's origin with --cors-origin", type="permission_error", code="cross_site_request")


def _kind(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()

