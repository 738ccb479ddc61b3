"""ControlNets over HTTP:

    GET /v1/controlnets   {"object": "list", "data": [{"name", "loaded", "bytes"}, ...]}: the ControlNets of the
                          server's --controlnet-dir (one sub-folder each), loaded now or not
    POST /v1/images/generations with "controls": [{"name", "image", "scale", "start", "end"}], each "image" a
                          base64 PNG, JPEG or WebP (a data: URL too): read here before the body's checks run

A body with controls may be as large as a multipart upload (ServerLimits.max_upload_bytes), each picture at most
as large as an edit's and checked before it is decoded with the same limits and errors (edits.py); a body without
them keeps the JSON limit (max_body_bytes).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from fastapi import APIRouter, Request

from .bodies import json_too_large, read_body
from .edits import _open
from .errors import invalid
from .forms import base64_picture
from .schemas import parse_body
from .state import ServerState


def controlnet_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/controlnets")
    async def list_controlnets() -> dict:
        store = getattr(state.engine.executor, "_controlnets", None)
        return {"object": "list", "data": store.listing() if store is not None else []}

    return router


async def read_generation(request: Request, state: ServerState):
    """The body of a generation, within the JSON limit, or the upload limit when it carries controls."""
    limits = state.limits
    raw = await read_body(request, max(limits.max_body_bytes, limits.max_upload_bytes))
    if len(raw) > limits.max_body_bytes and b'"controls"' not in raw and b'"ip_adapter"' not in raw:
        raise await json_too_large(raw, limits.max_body_bytes)
    req = parse_body(raw, limits)
    if len(raw) > limits.max_body_bytes and not req.controls and req.ip_adapter is None:
        raise await json_too_large(raw, limits.max_body_bytes)
    return req


async def with_controls(req, params: list, state: ServerState) -> list:
    """`params` with the body's controls, their pictures checked (headers) then decoded off the event loop; a body
    without controls comes back as it is. Its image prompt's picture too (ip_adapters.py)."""
    from .ip_adapters import with_ip_adapter

    params = await with_ip_adapter(req, params, state)
    if not req.controls:
        return params
    model = state.engine.model_info
    controls = []
    for i, item in enumerate(req.controls):
        if isinstance(item, dict) and isinstance(item.get("image"), str):
            field = f"controls[{i}].image"
            item = {**item, "image": _open(base64_picture(item["image"], field), field, model)}
        controls.append(item)
    controls = await asyncio.to_thread(_decode, controls)
    return [replace(p, controls=controls) for p in params]


def _decode(controls: list) -> list:
    for i, item in enumerate(controls):
        picture = item.get("image") if isinstance(item, dict) else None
        if picture is not None and hasattr(picture, "load"):
            try:
                picture.load()
            except Exception:  # noqa: BLE001 - a header that reads but pixels that do not (a truncated file)
                raise invalid(f"controls[{i}].image: not a readable PNG, JPEG or WebP image (its pixels could not "
                              f"be decoded)", f"controls[{i}].image") from None
            item["image"] = picture.convert("RGB") if picture.mode != "RGB" else picture
    return controls
