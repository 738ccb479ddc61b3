"""The load generator's target for a Triton Inference Server, over Triton's own protocol (KServe v2).

    --target triton=grpc://127.0.0.1:8001            the model `pipeline` over gRPC
    --target triton=http://127.0.0.1:8000/MODEL      another model name, over HTTP
    --target triton:classic=grpc://127.0.0.1:8001    the same, labelled "classic" in the report

The model takes one request per batch row, every input with dims [1] (so shape [1, 1] per request): prompt
(BYTES), seed (INT64), steps (INT32), guidance_scale (FP32), and optionally negative_prompt, sampler (BYTES), height,
width (INT32); it answers `image`, uint8 (1, H, W, C). At start the target reads the model's config: a decoupled
model (`model_transaction_policy { decoupled: true }`) is driven over gRPC bidirectional streaming, since Triton
refuses decoupled models on plain infer (HTTP and gRPC alike); any other model with plain infer, over HTTP or gRPC.

Replies: an error starting with "queue full" (or Triton's own "Exceeds maximum queue size") is REJECTED with reason
queue_full; a request with timeout_s that is not answered by then is TIMEOUT (the gRPC deadline, or the client
giving up over HTTP); any other error is FAILED with Triton's message. Triton does not say where a request's time
went, so queue/denoise/decode and batch sizes are left empty.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .targets import FAILED, OK, Reply, StepSample
from .triton_stream import SharedStream
from .triton_wire import (FALLBACK_DEFAULTS, ModelInputs, deadline_status, error_reply, is_final, numpy_array,
                          request_tensors, to_image)
from .workload import RequestSpec

__all__ = ["FALLBACK_DEFAULTS", "ModelInputs", "TritonAddress", "TritonTarget", "is_triton_target",
           "parse_triton_target", "request_tensors"]

log = logging.getLogger(__name__)

TRITON_PREFIX = "triton"
DEFAULT_MODEL = "pipeline"
DEFAULT_PORTS = {"grpc": 8001, "http": 8000}
STREAM_MODES = ("shared", "per-request")  # decoupled models: one gRPC stream for all requests, or one each


@dataclass(frozen=True)
class TritonAddress:
    """Where a Triton target is: protocol (grpc | http), host:port, model name, and its label in the report."""

    protocol: str
    host_port: str
    model: str
    label: str

    @property
    def url(self) -> str:
        return f"{self.protocol}://{self.host_port}/{self.model}"


def is_triton_target(text: str) -> bool:
    """'triton=URL' or 'triton:LABEL=URL'."""
    head = text.split("=", 1)[0]
    return "=" in text and (head == TRITON_PREFIX or head.startswith(TRITON_PREFIX + ":"))


def parse_triton_target(text: str) -> TritonAddress:
    """'triton=grpc://HOST:PORT[/MODEL]' or 'triton:LABEL=http://HOST:PORT[/MODEL]'; ValueError names what is wrong."""
    head, _, url = text.partition("=")
    label = head.partition(":")[2] if ":" in head else ""
    usage = "expected triton=grpc://HOST:PORT[/MODEL] or triton=http://HOST:PORT[/MODEL] (triton:LABEL=URL to name it)"
    parts = urlsplit(url)
    if parts.scheme not in DEFAULT_PORTS:
        raise ValueError(f"--target {text!r}: the scheme must be grpc:// or http://; {usage}")
    try:
        port = parts.port or DEFAULT_PORTS[parts.scheme]
    except ValueError:
        raise ValueError(f"--target {text!r}: the port is not a number; {usage}") from None
    if not parts.hostname:
        raise ValueError(f"--target {text!r}: no host; {usage}")
    model = parts.path.strip("/") or DEFAULT_MODEL
    if "/" in model or parts.query or parts.fragment:
        raise ValueError(f"--target {text!r}: the path may only name the model; {usage}")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    url = f"{parts.scheme}://{host}:{port}/{model}"
    return TritonAddress(parts.scheme, f"{host}:{port}", model, label or f"{TRITON_PREFIX}={url}")


class TritonTarget:
    """A Triton model over KServe v2: plain infer (gRPC or HTTP), or gRPC streaming for a decoupled model."""

    def __init__(self, address: TritonAddress | str, keep_images: bool = False, stream_mode: str = "shared") -> None:
        self.address = parse_triton_target(address) if isinstance(address, str) else address
        if stream_mode not in STREAM_MODES:
            raise ValueError(f"stream_mode {stream_mode!r} not supported; allowed: {', '.join(STREAM_MODES)}")
        self.name = self.address.label
        self.keep_images = keep_images
        self.stream_mode = stream_mode
        self.model: ModelInputs | None = None
        self._client = None
        self._stream: SharedStream | None = None

    async def start(self) -> None:
        try:
            from tritonclient.utils import InferenceServerException
        except ImportError as exc:
            raise ValueError(f"Triton target {self.address.url}: tritonclient is missing ({exc}); "
                             "install stepserve[triton]") from None
        if self.address.protocol == "grpc":
            import tritonclient.grpc.aio as grpcclient

            self._client = grpcclient.InferenceServerClient(self.address.host_port)
        else:
            import tritonclient.http.aio as httpclient

            # No connection cap and no client-side total timeout: deadlines are the load generator's business.
            self._client = httpclient.InferenceServerClient(self.address.host_port, conn_limit=0, conn_timeout=None)
        try:
            config = await self._client.get_model_config(self.address.model, **self._json())
        except InferenceServerException as exc:
            await self.stop()
            raise ValueError(f"Triton target {self.address.url}: cannot read the model's config: {exc}") from None
        self.model = ModelInputs.from_config(config.get("config", config))
        if self.model.decoupled and self.address.protocol != "grpc":
            await self.stop()
            raise ValueError(f"Triton target {self.address.url}: model {self.address.model!r} is decoupled, and "
                             "Triton serves decoupled models only over gRPC streaming; give its gRPC port instead, "
                             f"e.g. triton=grpc://{self.address.host_port.rsplit(':', 1)[0]}:8001/"
                             f"{self.address.model}")
        if self.model.decoupled and self.stream_mode == "shared":
            self._stream = SharedStream(self.address.host_port, self.address.model)

    def _json(self) -> dict[str, Any]:
        return {"as_json": True} if self.address.protocol == "grpc" else {}

    async def send(self, spec: RequestSpec) -> Reply:
        tensors = request_tensors(spec, self.model)
        if self._stream is not None:
            result = await self._stream.infer(tensors, spec.timeout_s)
        elif self.model.decoupled:
            result = await self._stream_one(tensors, spec.timeout_s)
        else:
            result = await self._infer(tensors, spec.timeout_s)
        if isinstance(result, Reply):
            return result
        try:
            image = result.as_numpy("image")
        except (ValueError, TypeError) as exc:  # the output cannot be decoded
            return Reply(FAILED, error=f"the answer's 'image' output is not readable: {exc}")
        if image is None:
            return Reply(FAILED, error="the answer has no 'image' output")
        return Reply(OK, image=to_image(image) if self.keep_images else None)

    def _inputs(self, tensors: list[tuple[str, str, Any]]):
        if self.address.protocol == "grpc":
            from tritonclient.grpc import InferInput
        else:
            from tritonclient.http import InferInput
        inputs = []
        for name, datatype, value in tensors:
            tensor = InferInput(name, [1, 1], datatype)
            tensor.set_data_from_numpy(numpy_array(datatype, value))
            inputs.append(tensor)
        return inputs

    async def _infer(self, tensors, timeout_s: float | None):
        """Plain infer: the result, or a Reply for an error."""
        from tritonclient.utils import InferenceServerException

        try:
            if self.address.protocol == "grpc":
                from tritonclient.grpc import InferRequestedOutput

                return await self._client.infer(self.address.model, self._inputs(tensors),
                                                outputs=[InferRequestedOutput("image")], client_timeout=timeout_s)
            from tritonclient.http import InferRequestedOutput

            call = self._client.infer(self.address.model, self._inputs(tensors),
                                      outputs=[InferRequestedOutput("image", binary_data=True)])
            return await asyncio.wait_for(call, timeout_s)
        except InferenceServerException as exc:
            return error_reply(exc.message(), exc.status(), deadline_status(exc.status()))
        except asyncio.TimeoutError:
            return error_reply(f"no answer within timeout_s {timeout_s:g} s", timed_out=True)
        except OSError as exc:  # the connection failed
            return Reply(FAILED, error=f"{type(exc).__name__}: {exc}")

    async def _stream_one(self, tensors, timeout_s: float | None):
        """A decoupled model, one gRPC stream for this request (its deadline is the stream's)."""
        import grpc

        done = asyncio.Event()

        async def requests():
            yield {"model_name": self.address.model, "inputs": self._inputs(tensors),
                   "parameters": {"triton_enable_empty_final_response": True}}
            await done.wait()  # keep the stream open until the final response

        responses = self._client.stream_infer(requests(), stream_timeout=timeout_s)
        answer = None
        try:
            async for result, error in responses:
                if error is not None:
                    return error_reply(error.message(), error.status())
                if result.get_output("image") is not None:
                    answer = result
                if is_final(result.get_response()):
                    break
        except grpc.RpcError as exc:  # the stream itself failed: its deadline passed, or the connection broke
            status = str(exc.code())
            return error_reply(exc.details(), status, deadline_status(status))
        finally:
            done.set()
            responses.cancel()
        return answer if answer is not None else Reply(FAILED, error="the stream ended without an answer")

    async def stop(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    def step_samples(self) -> list[StepSample]:
        return []

    async def busy_seconds(self) -> float | None:
        """Triton's model statistics do not say how long the model was busy for a decoupled model (its execute
        returns before the work is done); for others the compute time of every batch is summed."""
        if self.model is None or self.model.decoupled:
            return None
        from tritonclient.utils import InferenceServerException

        try:
            stats = await self._client.get_inference_statistics(self.address.model, **self._json())
        except InferenceServerException as exc:  # statistics disabled or restricted: the utilisation is left out
            log.debug("Triton statistics of %s not read: %s", self.address.url, exc)
            return None
        total_ns = 0
        for model in stats.get("model_stats", []):
            for batch in model.get("batch_stats", []):
                total_ns += int(batch.get("compute_infer", {}).get("ns", 0))
        return total_ns / 1e9
