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
import contextlib
import itertools
import logging
import re
import struct
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .targets import FAILED, OK, REJECTED, TIMEOUT, Reply, StepSample
from .workload import RequestSpec

log = logging.getLogger(__name__)

TRITON_PREFIX = "triton"
DEFAULT_MODEL = "pipeline"
DEFAULT_PORTS = {"grpc": 8001, "http": 8000}
STREAM_MODES = ("shared", "per-request")  # decoupled models: one gRPC stream for all requests, or one each
QUEUE_FULL = "queue_full"
QUEUE_FULL_MESSAGES = ("queue full", "exceeds maximum queue size")  # stepserve's model; Triton's dynamic batcher
_REQUEST_ID = re.compile(r"^\[request id: [^\]]*\]\s*")  # Triton's own errors start with it
# Sent when a request leaves a field to the model's default but the model's config makes that input required:
# the embedded model's serving defaults.
FALLBACK_DEFAULTS = {"steps": 15, "guidance_scale": 3.0}


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


@dataclass(frozen=True)
class ModelInputs:
    """What the model's config says about its inputs: names, which are optional, and whether it is decoupled."""

    names: frozenset[str]
    optional: frozenset[str]
    decoupled: bool
    max_batch_size: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelInputs:
        inputs = config.get("input", [])
        return cls(frozenset(i["name"] for i in inputs), frozenset(i["name"] for i in inputs if i.get("optional")),
                   bool(config.get("model_transaction_policy", {}).get("decoupled")),
                   int(config.get("max_batch_size", 0)))


def request_tensors(spec: RequestSpec, model: ModelInputs) -> list[tuple[str, str, Any]]:
    """(name, Triton datatype, value) for each input to send: fields left to the model's default are left out when
    the model's input is optional (or absent), else sent as FALLBACK_DEFAULTS."""
    fields = [("prompt", "BYTES", spec.prompt), ("negative_prompt", "BYTES", spec.negative_prompt or None),
              ("seed", "INT64", spec.seed), ("steps", "INT32", spec.num_inference_steps),
              ("guidance_scale", "FP32", spec.guidance_scale), ("sampler", "BYTES", spec.sampler),
              ("height", "INT32", spec.height), ("width", "INT32", spec.width)]
    out = []
    for name, datatype, value in fields:
        if value is None and (name in model.optional or name not in model.names or name not in FALLBACK_DEFAULTS):
            continue
        out.append((name, datatype, FALLBACK_DEFAULTS[name] if value is None else value))
    return out


_NUMPY = {"INT64": "int64", "INT32": "int32", "FP32": "float32"}


def _array(datatype: str, value: Any):
    import numpy as np

    if datatype == "BYTES":
        return np.array([[str(value).encode()]], dtype=object)
    return np.array([[value]], dtype=_NUMPY[datatype])


def _raw_bytes(datatype: str, value: Any) -> bytes:
    """One element in KServe v2's raw tensor encoding (BYTES: 4-byte little-endian length, then the bytes)."""
    if datatype == "BYTES":
        data = str(value).encode()
        return struct.pack("<I", len(data)) + data
    return _array(datatype, value).tobytes()


def to_image(array):
    """The model's uint8 (1, H, W, C) (or (H, W, C)) output as a PIL image."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(array, dtype=np.uint8)
    if pixels.ndim == 4:
        pixels = pixels[0]
    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    return Image.fromarray(pixels)


def error_reply(message: str, status: str | None = None, timed_out: bool = False) -> Reply:
    """A Triton error as the load generator counts it."""
    text = message or status or "unknown error"
    if timed_out:
        return Reply(TIMEOUT, error=f"deadline exceeded: {text}", reason="deadline_exceeded")
    if _REQUEST_ID.sub("", text.strip()).lower().startswith(QUEUE_FULL_MESSAGES):
        return Reply(REJECTED, error=text, reason=QUEUE_FULL)
    return Reply(FAILED, error=f"[{status}] {text}" if status else text)


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
            tensor.set_data_from_numpy(_array(datatype, value))
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
            return error_reply(exc.message(), exc.status(), _deadline_status(exc.status()))
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
                if _is_final(result.get_response()):
                    break
        except grpc.RpcError as exc:  # the stream itself failed: its deadline passed, or the connection broke
            status = str(exc.code())
            return error_reply(exc.details(), status, _deadline_status(status))
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


def _deadline_status(status: str | None) -> bool:
    return status is not None and "DEADLINE_EXCEEDED" in status


def _is_final(response) -> bool:
    param = response.parameters.get("triton_final_response")
    return param is not None and param.bool_param


class SharedStream:
    """One gRPC bidirectional stream for every request of a decoupled model; answers are matched by request id.

    The stream is opened on the first request and again after it broke (its pending requests fail). A request
    whose deadline passes is answered TIMEOUT here; the server is not told (one request on a shared stream cannot
    be cancelled), and its late answer is dropped."""

    def __init__(self, host_port: str, model: str) -> None:
        self.host_port = host_port
        self.model = model
        self._ids = itertools.count()
        self._pending: dict[str, tuple[asyncio.Future, list]] = {}
        self._queue: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None
        self._channel = None

    def _open(self) -> None:
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        if self._channel is None:
            limit = 2**31 - 1
            self._channel = grpc.aio.insecure_channel(self.host_port, options=[
                ("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)])
        self._queue = asyncio.Queue()
        queue = self._queue

        async def requests():
            while True:
                item = await queue.get()
                if item is None:
                    return
                yield item

        call = service_pb2_grpc.GRPCInferenceServiceStub(self._channel).ModelStreamInfer(requests())
        self._reader = asyncio.create_task(self._read(call, queue))

    async def _read(self, call, queue: asyncio.Queue) -> None:
        import grpc

        error = "the stream ended"
        try:
            async for message in call:
                entry = self._pending.get(message.infer_response.id)
                if entry is None:
                    continue  # the request already gave up (deadline)
                answers = entry[1]
                if message.error_message:
                    self._finish(message.infer_response.id, error_reply(message.error_message))
                    continue
                if any(o.name == "image" for o in message.infer_response.outputs):
                    answers.append(message.infer_response)
                if _is_final(message.infer_response):
                    self._finish(message.infer_response.id, answers[-1] if answers else
                                 Reply(FAILED, error="the final response came without an answer"))
        except grpc.aio.AioRpcError as exc:
            error = f"[{exc.code()}] {exc.details()}"
        except asyncio.CancelledError:
            error = "the stream was closed"
            raise
        finally:
            if self._queue is queue:  # this stream is done: the next request opens another
                self._queue = None
            for request_id in list(self._pending):
                self._finish(request_id, Reply(FAILED, error=f"gRPC stream broke: {error}"))

    def _finish(self, request_id: str, outcome) -> None:
        future, _ = self._pending.pop(request_id, (None, None))
        if future is not None and not future.done():
            future.set_result(outcome)

    async def infer(self, tensors, timeout_s: float | None):
        """The answer (an InferResult), or a Reply for an error or a missed deadline."""
        from tritonclient.grpc import InferResult, service_pb2

        if self._queue is None:
            self._open()
        request_id = str(next(self._ids))
        request = service_pb2.ModelInferRequest(model_name=self.model, id=request_id)
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        for name, datatype, value in tensors:
            request.inputs.add(name=name, datatype=datatype, shape=[1, 1])
            request.raw_input_contents.append(_raw_bytes(datatype, value))
        request.outputs.add(name="image")
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, [])
        self._queue.put_nowait(request)
        try:
            outcome = await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return error_reply(f"no answer within timeout_s {timeout_s:g} s", timed_out=True)
        finally:
            self._pending.pop(request_id, None)
        return InferResult(outcome) if not isinstance(outcome, Reply) else outcome

    async def close(self) -> None:
        if self._queue is not None:
            self._queue.put_nowait(None)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._channel is not None:
            await self._channel.close()
