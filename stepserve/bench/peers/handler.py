"""The per-batch work every peer's handler does, so that only the batching differs between contenders.

A peer (Ray Serve's @serve.batch, LitServe's batched predict) hands over a batch of request bodies; they run
together, as a whole-request batch, through stepserve's executor and samplers (the engine with the static policy:
the batch starts at once and ends when its longest request is done; nothing joins it), exactly what Triton's
classic layout does with a batch from its dynamic batcher (deploy/triton/models/classic_pipeline.py). Bodies are
parsed and checked by the stepserve server's own rules, and answers use its response shape (OpenAI images:
{"created", "data": [{"b64_json": PNG}]}), so the load generator drives every HTTP peer the same way.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ...request.types import SamplingParams

IMAGES_PATH = "/v1/images/generations"


class PeerRequestError(Exception):
    """A request the handler refuses (HTTP 400), with the message of stepserve's own server."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": None, "code": None}}


@dataclass(frozen=True)
class HandlerOptions:
    """What every peer's handler is built from (passed to a peer server on its command line)."""

    model: str = "embedded"
    backend: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1
    max_batch_size: int = 8

    def argv(self) -> list[str]:
        return ["--model", self.model, "--backend", self.backend, "--device", self.device, "--dtype", self.dtype,
                "--threads", str(self.threads), "--max-batch-size", str(self.max_batch_size)]


def add_handler_args(parser) -> None:
    """The HandlerOptions flags, for a peer server's argparse parser."""
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=8)


def options_from(args) -> HandlerOptions:
    return HandlerOptions(args.model, args.backend, args.device, args.dtype, args.threads, args.max_batch_size)


class BatchHandler:
    """parse(body) -> one request's SamplingParams (or PeerRequestError); run(batch) -> one answer per request."""

    def __init__(self, options: HandlerOptions) -> None:
        from ...api import Engine
        from ...engine.config import EngineConfig, EngineOptions, build_engine

        batching = EngineOptions(strategy="static", max_batch_size=options.max_batch_size)
        built = build_engine(EngineConfig(model=options.model, device=options.device, dtype=options.dtype,
                                          backend=options.backend, threads=options.threads, memory_cap=False,
                                          options=batching))
        self.engine = Engine(built.executor, options=built.options)

    def parse(self, body: bytes | str | dict) -> list[SamplingParams]:
        from ...server.errors import APIError
        from ...server.schemas import ServerLimits, engine_params, parse_body
        from ...request.validation import ValidationError, resolve_params

        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        raw = raw.encode() if isinstance(raw, str) else raw
        try:
            request = parse_body(raw, ServerLimits())
            if request.stream:
                raise PeerRequestError("stream: peers answer whole images only (send \"stream\": false)")
            params = engine_params(request, ServerLimits())
            # resolved here, once: a bad field fails this request alone, never its batch
            params = [resolve_params(p, self.engine.model_info) for p in params]
        except APIError as exc:
            raise PeerRequestError(str(getattr(exc, "message", exc))) from None
        except ValidationError as exc:
            raise PeerRequestError(str(exc)) from None
        return params

    def run(self, batch: list[list[SamplingParams]]) -> list[dict[str, Any]]:
        """Every request of the batch through the engine at once; answers in batch order. A request whose image
        failed gets {"error": ...} (HTTP 500 from the peer)."""
        from ...server.images import png_b64

        flat = [p for params in batch for p in params]
        results = self.engine.generate(flat) if flat else []
        out, start = [], 0
        for params in batch:
            mine, start = results[start:start + len(params)], start + len(params)
            failed = [r for r in mine if not r.ok]
            if failed:
                out.append({"error": {"message": f"generation failed: {failed[0].error or failed[0].status.value}",
                                      "type": "server_error", "param": None, "code": None}})
            else:
                out.append({"created": int(time.time()), "data": [{"b64_json": png_b64(r.image)} for r in mine]})
        return out


def status_of(answer: dict[str, Any]) -> int:
    return 500 if "error" in answer else 200
