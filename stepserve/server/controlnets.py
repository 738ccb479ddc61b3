"""ControlNets and image prompts over HTTP:

    GET /v1/controlnets   {"object": "list", "data": [{"name", "loaded", "bytes"}, ...]}: the ControlNets of the
                          server's --controlnet-dir (one sub-folder each), loaded now or not
    POST /v1/images/generations with "controls": [{"name", "image", "scale", "start", "end"}] and/or "ip_adapter"
                          (ip_adapters.py), each "image" a base64 PNG, JPEG or WebP (a data: URL too)

A body may pass the JSON limit (max_body_bytes) only by its pictures: up to a multipart upload's
(ServerLimits.max_upload_bytes), with the rest of the body within the JSON limit; a large body is parsed off the
event loop. Its pictures are checked, decoded (pictures.py) and preprocessed (Canny) once per request, not once
per image of `n`, in a worker thread (resolved_addons), and the request's add-ons resolved there, with the same
checks and errors as any request (request/control_params.py, request/image_prompt.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from functools import partial

from fastapi import APIRouter, Request

from ..caching.spec import CacheSpecError
from ..request.control_params import resolve_controls
from ..request.image_prompt import resolve_ip_adapter
from ..util.field_error import FieldError
from .bodies import TEXT_ADVICE, json_too_large, read_body, too_large
from .errors import invalid
from .pictures import sent_picture
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
    """The body of a generation, within the JSON limit but for its pictures (up to the upload limit)."""
    limits = state.limits
    raw = await read_body(request, max(limits.max_body_bytes, limits.max_upload_bytes))
    if len(raw) <= limits.max_body_bytes:
        return parse_body(raw, limits)
    if b'"controls"' not in raw and b'"ip_adapter"' not in raw:  # nothing in it may pass the limit: named, not parsed
        raise await json_too_large(raw, limits.max_body_bytes)
    req = await asyncio.to_thread(parse_body, raw, limits)  # megabytes: off the event loop
    if len(raw) - _picture_chars(req) > limits.max_body_bytes:
        raise too_large(limits.max_body_bytes, f"{TEXT_ADVICE} (only the pictures of controls and ip_adapter may "
                                               f"pass this limit)")
    return req


def _picture_chars(req) -> int:
    """The characters of the body's base64 pictures (its controls' and image prompts' images)."""
    prompts = req.ip_adapter if isinstance(req.ip_adapter, list) else [req.ip_adapter]
    return sum(len(item["image"]) for item in [*(req.controls or ()), *prompts]
               if isinstance(item, dict) and isinstance(item.get("image"), str))


async def with_controls(req, params: list, state: ServerState) -> list:
    """`params` (one per image of a generation's `n`) with the body's controls and image prompt(s): their base64
    pictures checked and decoded (pictures.py), then resolved once for the request (resolved_addons)."""
    if not req.controls and req.ip_adapter is None:
        return params
    params = [replace(p, controls=req.controls, ip_adapter=req.ip_adapter) for p in params]
    return await resolved_addons(params, partial(sent_picture, model=state.engine.model_info), state)


async def resolved_addons(params: list, to_image, state: ServerState) -> list:
    """`params` (the images of one request) with their controls and image prompts resolved once, in a worker
    thread: each picture made an RGB image by `to_image(field, picture)`, a Canny map made from it, the checks
    of any request run (a 400 naming the field); every image of `n` then shares them, and the engine's own
    resolution takes them as they are."""
    first = params[0]
    if not first.controls and first.ip_adapter is None:
        return params
    controls, prompts = await asyncio.to_thread(_resolve, first, state.engine.model_info, to_image)
    return [replace(p, controls=controls, ip_adapter=prompts) for p in params]


def _resolve(p, model, to_image) -> tuple:
    try:
        return resolve_controls(p, model, p.image, to_image), resolve_ip_adapter(p, model, to_image)
    except FieldError as exc:
        raise invalid(f"{exc.field}: {exc}", exc.field) from None
    except CacheSpecError as exc:  # read by the controls' checks (caching with controls) before the request's own
        raise invalid(f"cache: {exc}", "cache") from None
