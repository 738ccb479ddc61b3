"""One gRPC bidirectional stream shared by every request to a decoupled Triton model (bench/triton_target.py's
`stream_mode="shared"`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

from .targets import FAILED, Reply
from .triton_wire import error_reply, is_final, raw_bytes


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
                if is_final(message.infer_response):
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
            request.raw_input_contents.append(raw_bytes(datatype, value))
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
