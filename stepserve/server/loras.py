"""The LoRA adapter endpoints (behind the API key): list, load from the adapter folder, delete while serving.

    GET    /v1/loras           {"object": "list", "data": [{"name", "path", "rank", "layers", "bytes", ...,
                               "registered", "replicas"}]}: the folder's adapters and the registrations, each with
                               the replicas holding it loaded now (details null where none does)
    POST   /v1/loras           {"name": ..., "path": ...} (Content-Type: application/json, at most 4 KiB): a file
                               inside the server's --lora-dir (a path relative to it, or absolute inside it),
                               loaded here, then registered in the state store for every replica; 201 with the
                               adapter
    DELETE /v1/loras/{name}    the registration is marked deleted (every replica refuses it within a few seconds);
                               here new requests naming it are refused at once and it is unloaded when no request
                               in the engine carries it any more (at most 60 s), between two steps. The answer says
                               what happened: {"deleted", "reloadable", "detail"} (an adapter whose file is in the
                               folder stays servable: it loads again when a request names it)

Replicas share the registrations through lora_registry.py.

Statuses come from the adapter errors' types (stepserve/lora/errors.py), the field from their `param`.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..lora.errors import (LoraBudgetError, LoraError, LoraInUseError, LoraNotFoundError, LoraTooLargeError,
                           LoraUnsupportedError)
from ..lora.gate import Deletion
from .bodies import check_json, read_body
from .errors import APIError, addon_failure, invalid

MAX_BODY_BYTES = 4096  # {"name", "path"}: a name of at most 64 characters and a path
SHAPE = ('expected a JSON object {"name": ..., "path": ...} (name: the adapter\'s name; path: a file in the adapter '
         "folder)")


def lora_error(exc: LoraError, not_found: int = 400) -> APIError:
    """The HTTP answer for an adapter error, by its type; `not_found`: 404 where the name is in the URL."""
    if isinstance(exc, (LoraBudgetError, LoraTooLargeError)):  # the answers of every add-on kind's (errors.py)
        return addon_failure(exc)
    if isinstance(exc, LoraInUseError):
        return APIError(409, str(exc), code="lora_in_use", param=exc.param)
    if isinstance(exc, LoraNotFoundError):
        return APIError(not_found, str(exc), code="lora_not_found", param=exc.param)
    if isinstance(exc, LoraUnsupportedError):
        return invalid(str(exc), exc.param, "lora_unsupported")
    return invalid(str(exc), exc.param)


def parse_load(raw: bytes) -> tuple[str, str]:
    """(name, path) of a POST /v1/loras body, or a 400 naming what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise invalid(f"the body is not valid JSON ({str(exc)[:80]}); {SHAPE}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"the body must be a JSON object, got {type(body).__name__}; {SHAPE}", code="invalid_json")
    if set(body) != {"name", "path"}:
        raise invalid(f"expected exactly the fields name and path, got {', '.join(map(repr, body)) or 'none'}; "
                      f"{SHAPE}", next((k for k in body if k not in ("name", "path")), None))
    for field in ("name", "path"):
        value = body[field]
        if not isinstance(value, str):
            raise invalid(f"{field}: must be a string, got {type(value).__name__}; {SHAPE}", field)
        if "\x00" in value:
            raise invalid(f"{field}: must not contain a NUL character", field)
    return body["name"], body["path"]


def deletion_body(done: Deletion) -> dict:
    if not done.unloaded and done.reloadable:
        detail = ("it was not loaded (unloaded earlier to make room, or never used); its file in the adapter folder "
                  "loads again when a request names it")
    elif not done.unloaded:
        detail = ("it was not loaded (unloaded earlier to make room, or never used); requests naming it are refused "
                  "until POST /v1/loras loads it again")
    elif done.reloadable:
        detail = "unloaded; its file in the adapter folder loads again when a request names it"
    else:
        detail = "unloaded; requests naming it are refused until POST /v1/loras loads it again"
    return {"deleted": done.name, "reloadable": done.reloadable, "detail": detail}


def lora_routes(state, registry) -> APIRouter:
    """`registry` (lora_registry.py): the registrations in the state store, shared by every replica."""
    router = APIRouter()

    def store():
        try:
            return state.engine.executor.adapters()
        except (AttributeError, LoraError) as exc:
            raise APIError(400, f"this server serves no LoRA adapters: {exc}", code="lora_unsupported") from None

    @router.get("/loras")
    async def list_loras() -> dict:
        return {"object": "list", "data": await registry.listing(store())}

    @router.post("/loras")
    async def load_lora(request: Request) -> JSONResponse:
        check_json(request)  # a web page cannot send JSON cross-origin without a preflight
        try:
            raw = await read_body(request, MAX_BODY_BYTES)
        except APIError as exc:
            if exc.status != 413:
                raise
            raise APIError(413, f"the body is larger than {MAX_BODY_BYTES // 1024} KiB; {SHAPE}",
                           code="body_too_large") from None
        name, path = parse_load(raw)
        if store().root is None:
            raise invalid("adapters are loaded only from a folder the server names: start it with --lora-dir DIR",
                          "path")
        taken = await registry.registration(name)
        if taken is not None:
            raise lora_error(LoraInUseError(f"adapter {name!r} is registered already (from {taken.path}); delete it "
                                            f"first to load another file as it"))
        try:
            info = await state.engine.load_adapter(name, path)
        except LoraError as exc:
            raise lora_error(exc) from None
        try:
            await registry.register(name, info.path)  # every replica serves it from now on
        except Exception as exc:  # noqa: BLE001 - the state store unreachable: served nowhere, this replica included
            await state.engine.delete_adapter(name)
            raise APIError(503, f"adapter {name!r} was not registered: the state store could not be written "
                                f"({type(exc).__name__}); retry later", type="server_error",
                           code="state_unavailable", headers={"Retry-After": "1"}) from None
        return JSONResponse(asdict(info), status_code=201)

    @router.delete("/loras/{name}")
    async def delete_lora(name: str) -> dict:
        store()
        record = await registry.unregister(name)  # first: every replica refuses it from its next sync
        try:
            return deletion_body(await state.engine.delete_adapter(name))
        except LoraNotFoundError as exc:
            if record is None:
                raise lora_error(exc, not_found=404) from None
            return deletion_body(Deletion(name, unloaded=False, reloadable=name in store().names))
        except LoraError as exc:
            if record is not None:  # still served here: registered again
                await registry.restore(record)
            raise lora_error(exc, not_found=404) from None

    return router
