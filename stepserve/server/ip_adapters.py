"""IP-Adapters over HTTP:

    GET /v1/ip-adapters   {"object": "list", "data": [{"name", "loaded", "bytes"}, ...]}: the IP-Adapters of the
                          server's --ip-adapter-dir (one sub-folder each), loaded now or not
    POST /v1/images/generations with "ip_adapter": {"name", "image", "scale"} (or a list of those, one per
                          adapter), "image" a base64 PNG, JPEG or WebP (a data: URL too): checked before decoding
                          with an edit's limits and errors, decoded off the event loop

A body with an image prompt may be as large as one with controls (controlnets.read_generation).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import APIRouter

from .errors import invalid
from .state import ServerState

FIELD = "ip_adapter.image"


def ip_adapter_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/ip-adapters")
    async def list_ip_adapters() -> dict:
        store = getattr(state.engine.executor, "_ip_adapters", None)
        return {"object": "list", "data": store.listing() if store is not None else []}

    return router


async def with_ip_adapter(req, params: list, state: ServerState) -> list:
    """`params` with the body's image prompt(s), each picture checked (header) then decoded off the event loop; a
    body without one comes back as it is."""
    item = getattr(req, "ip_adapter", None)
    if item is None:
        return params
    if isinstance(item, list):
        item = [await _with_picture(one, f"ip_adapter[{i}].image", state) for i, one in enumerate(item)]
    else:
        item = await _with_picture(item, FIELD, state)
    return [replace(p, ip_adapter=item) for p in params]


async def _with_picture(item, field: str, state: ServerState):
    from .edits import _open
    from .forms import base64_picture

    if isinstance(item, dict) and isinstance(item.get("image"), str):
        picture = _open(base64_picture(item["image"], field), field, state.engine.model_info)
        return {**item, "image": await asyncio.to_thread(_decode, picture, field)}
    return item


def _decode(picture, field: str = FIELD):
    try:
        picture.load()
    except Exception:  # noqa: BLE001 - a header that reads but pixels that do not (a truncated file)
        raise invalid(f"{field}: not a readable PNG, JPEG or WebP image (its pixels could not be decoded)",
                      field) from None
    return picture.convert("RGB") if picture.mode != "RGB" else picture
