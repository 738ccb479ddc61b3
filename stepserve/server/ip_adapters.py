"""IP-Adapters over HTTP:

    GET /v1/ip-adapters   {"object": "list", "data": [{"name", "loaded", "bytes"}, ...]}: the IP-Adapters of the
                          server's --ip-adapter-dir (one sub-folder each), loaded now or not
    POST /v1/images/generations with "ip_adapter": {"name", "image", "scale"} (or a list of those, one per
                          adapter), "image" a base64 PNG, JPEG or WebP (a data: URL too): read with a body's
                          controls (controlnets.py: the size limit, the pictures decoded off the event loop once
                          per request)
"""

from __future__ import annotations

from fastapi import APIRouter

from .state import ServerState


def ip_adapter_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/ip-adapters")
    async def list_ip_adapters() -> dict:
        store = getattr(state.engine.executor, "_ip_adapters", None)
        return {"object": "list", "data": store.listing() if store is not None else []}

    return router
