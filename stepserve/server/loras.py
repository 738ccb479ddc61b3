"""The LoRA adapter endpoints (behind the API key): list, load from the adapter folder, delete while serving.

    GET    /v1/loras           {"object": "list", "data": [{"name", "path", "rank", "layers", "bytes"}]}
    POST   /v1/loras           {"name": ..., "path": ...}: a file inside the server's --lora-dir (a path relative
                               to it, or absolute inside it); 201 with the adapter
    DELETE /v1/loras/{name}    new requests naming it are refused at once; it is unloaded when no request in the
                               engine carries it any more (at most 60 s), between two steps
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ..lora.errors import LoraError
from ..lora.store import LoraBudgetError
from .errors import APIError, invalid


def lora_routes(state) -> APIRouter:
    router = APIRouter()

    def store():
        try:
            return state.engine.executor.adapters()
        except (AttributeError, LoraError) as exc:
            raise APIError(400, f"this server serves no LoRA adapters: {exc}", code="lora_unsupported") from None

    @router.get("/loras")
    async def list_loras() -> dict:
        adapters = store()
        return {"object": "list", "data": [asdict(a) for n, a in sorted(adapters.adapters.items())
                                           if n in adapters.names]}

    @router.post("/loras")
    async def load_lora(request: Request) -> JSONResponse:
        adapters = store()
        if adapters.root is None:
            raise invalid("adapters are loaded only from a folder the server names: start it with --lora-dir DIR",
                          "path")
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise invalid("expected a JSON object {\"name\": ..., \"path\": ...}") from None
        if not isinstance(body, dict) or set(body) != {"name", "path"} or not isinstance(body.get("path"), str):
            raise invalid("expected exactly {\"name\": ..., \"path\": ...} (path: a file in the adapter folder)")
        try:
            info = await asyncio.to_thread(state.engine.adapter_gate.load, body["name"], body["path"])
        except LoraBudgetError as exc:
            raise APIError(429, str(exc), type="rate_limit_error", code="lora_memory_full", param="name",
                           headers={"Retry-After": "1"}) from None
        except LoraError as exc:
            raise invalid(str(exc), "path" if "path" in str(exc) else "name") from None
        return JSONResponse(asdict(info), status_code=201)

    @router.delete("/loras/{name}")
    async def delete_lora(name: str) -> dict:
        store()
        try:
            await state.engine.delete_adapter(name)
        except LoraError as exc:
            status = 404 if "is not loaded" in str(exc) else 409
            raise APIError(status, str(exc), code="lora_not_found" if status == 404 else "lora_in_use",
                           param="name") from None
        return {"deleted": name}

    return router
