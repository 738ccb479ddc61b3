"""The stepserve layout's entry model: a decoupled model that runs stepserve's AsyncEngine inside Triton.

execute() only validates and submits: each request joins the engine's queue at once and the engine (continuous
batching by default) lets it join the running batch at the next denoising step. The answer is sent from the
engine's completion, on the model's own event-loop thread, with the FINAL flag; execute() returns before any
image exists. A full queue is answered at once with an error that starts with "queue full".

A request that Triton reports cancelled (the client cancelled it or went away) is aborted in the engine, which
frees its slot at the next step. An optional `timeout_s` input is the request's deadline, as in the HTTP API.

Settings come from the config's `parameters`: strategy, max_batch_size, max_queue, max_queue_delay_ms, backend
(onnxruntime or torch), threads (onnxruntime intra-op threads), torch_threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import triton_python_backend_utils as pb_utils

from stepserve.engine.async_engine import DEFAULT_ANSWER_MARGIN_S, AsyncEngine
from stepserve.engine.admission_errors import AdmissionError, QueueFullError
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine
from stepserve.engine.loading import load_executor
from stepserve.scheduling import DEFAULT_MAX_QUEUE_DELAY_MS, DEFAULT_STRATEGY

from .requests import (
    QUEUE_FULL_PREFIX,
    BadRequest,
    parse_request,
    request_inputs,
    stack_images,
)
from .settings import limit_torch_threads, model_parameters, optional_int, version_dir

log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 5.0
CANCEL_POLL_S = 0.05  # how often a waiting request checks whether Triton cancelled it


def _final(sender, response) -> None:
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _error(message: str, request_id: str):
    """An error reply. tritonclient's stream callback drops the id of an error reply, so the message ends with it
    (a client sharing one stream among requests needs it); it must not start with it: "queue full" leads."""
    suffix = f" [request id: {request_id}]" if request_id else ""
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message + suffix))


def _is_cancelled(sender) -> bool:
    check = getattr(sender, "is_cancelled", None)  # the Python backend's request cancellation (Triton >= 23.10)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # noqa: BLE001 - a backend without the check: never cancelled
        return False


def _cancelled_error(request_id: str):
    code = getattr(pb_utils.TritonError, "CANCELLED", None)
    suffix = f" [request id: {request_id}]" if request_id else ""
    message = "cancelled: the request was aborted in the engine" + suffix
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(error=error)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        limit_torch_threads(optional_int(params.get("torch_threads")))
        backend = params.get("backend", "onnxruntime")
        folder = version_dir(args) / ("export" if backend == "onnxruntime" else "diffusers")
        executor = load_executor(str(folder), backend=backend, threads=optional_int(params.get("threads")))
        options = EngineOptions(strategy=params.get("strategy", DEFAULT_STRATEGY),
                                max_batch_size=int(params.get("max_batch_size", "8")),
                                max_queue=optional_int(params.get("max_queue")),
                                max_queue_delay_ms=float(params.get("max_queue_delay_ms", DEFAULT_MAX_QUEUE_DELAY_MS)),
                                answer_margin_s=DEFAULT_ANSWER_MARGIN_S)
        built = build_engine(EngineConfig(model=str(folder), backend=backend, memory_cap=False, options=options),
                             executor=executor)  # torch's threads are set above: it runs only the samplers here
        self.engine = AsyncEngine(built.executor, options=built.options)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stepserve-triton-loop", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.engine.start(), self.loop).result()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            rid = request.request_id()
            inputs = request_inputs(request, pb_utils.get_input_tensor_by_name)
            try:
                parsed = parse_request(inputs, self.engine.model_info)
                asyncio.run_coroutine_threadsafe(self._submit(parsed.params, sender, rid), self.loop).result()
            except BadRequest as e:
                _final(sender, _error(str(e), rid))
            except QueueFullError as e:
                _final(sender, _error(f"{QUEUE_FULL_PREFIX}: {e}", rid))
            except AdmissionError as e:  # refused by the policy (a deadline it cannot meet)
                _final(sender, _error(f"refused: {e}", rid))
            except Exception as e:  # noqa: BLE001 - shutting down, or the engine died: say so, serve the rest
                _final(sender, _error(f"{type(e).__name__}: {e}", rid))

    async def _submit(self, params, sender, request_id: str) -> None:
        """Runs on the loop thread (the engine's futures belong to it); raises when the engine refuses."""
        handles = self.engine.submit_many(params)
        self.loop.create_task(self._answer(handles, sender, request_id))

    async def _answer(self, handles, sender, request_id: str) -> None:
        try:
            results = await self._results_unless_cancelled(handles, sender)
            failed = [r for r in results or [] if not r.ok]
            if results is None:  # the client cancelled: its requests were aborted in the engine
                response = _cancelled_error(request_id)
            elif failed:
                response = _error(f"generation failed: {failed[0].error or failed[0].status.value}", request_id)
            else:
                response = pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("image", stack_images([r.image for r in results]))])
        except Exception as e:  # noqa: BLE001 - every request gets its one final response
            response = _error(f"{type(e).__name__}: {e}", request_id)
        try:
            _final(sender, response)
        except Exception:
            log.warning("could not send a response (the client may have gone)", exc_info=True)

    async def _results_unless_cancelled(self, handles, sender):
        """The results in order, or None when Triton reports the request cancelled (the client went away or
        cancelled it; polled every CANCEL_POLL_S): its engine requests are then aborted, freeing their slots."""
        gathered = asyncio.gather(*(h.result() for h in handles))
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=CANCEL_POLL_S)
            if done:
                return gathered.result()
            if _is_cancelled(sender):
                gathered.cancel()
                for h in handles:
                    self.engine.abort(h.request_id)
                return None

    def finalize(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.engine.shutdown(SHUTDOWN_GRACE_S), self.loop).result(
                SHUTDOWN_GRACE_S + 15)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
