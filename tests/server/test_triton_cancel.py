"""The stepserve Triton model aborts a request that Triton reports cancelled (checked with a stand-in for the
Python backend's module, so it runs without tritonserver): its engine requests end CANCELLED, freeing their slots."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types

from stepserve.engine.async_engine import AsyncEngine
from stepserve.costs import FakeExecutor
from stepserve.request.types import RequestStatus, SamplingParams


class _Error:
    CANCELLED = "CANCELLED"

    def __init__(self, message, code=None):
        self.message, self.code = message, code


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors, error


class Sender:
    def __init__(self):
        self.cancelled = False
        self.sent: list = []

    def is_cancelled(self):
        return self.cancelled

    def send(self, response, flags=0):
        self.sent.append((response, flags))


class SlowSteps(FakeExecutor):
    def denoise(self, requests):
        time.sleep(0.01)
        return super().denoise(requests)


def test_a_cancelled_triton_request_is_aborted_in_the_engine(monkeypatch):
    fake = types.SimpleNamespace(TritonError=_Error, InferenceResponse=_Response, Tensor=lambda *a: a,
                                 TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    monkeypatch.delitem(sys.modules, "stepserve.server.triton.stepserve_pipeline", raising=False)
    from stepserve.server.triton.stepserve_pipeline import TritonPythonModel

    model = TritonPythonModel()
    model.engine = AsyncEngine(SlowSteps(), strategy="continuous", max_batch_size=2)
    model.loop = asyncio.new_event_loop()
    model.thread = threading.Thread(target=model.loop.run_forever, daemon=True)
    model.thread.start()
    try:
        asyncio.run_coroutine_threadsafe(model.engine.start(), model.loop).result()
        sender = Sender()
        params = [SamplingParams(prompt="long", seed=i, num_inference_steps=200) for i in range(2)]
        handles = asyncio.run_coroutine_threadsafe(_submit(model, params, sender), model.loop).result()
        deadline = time.monotonic() + 240  # bounds a hang only
        while model.engine.running_count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        sender.cancelled = True
        results = asyncio.run_coroutine_threadsafe(_results(handles), model.loop).result(240)
        assert [r.status for r in results] == [RequestStatus.CANCELLED] * 2
        assert all(len(r.timing.batch_sizes) < 200 for r in results)
        deadline = time.monotonic() + 240
        while not sender.sent and time.monotonic() < deadline:
            time.sleep(0.01)
        ((response, flags),) = sender.sent
        assert flags == 1 and response.error.code == "CANCELLED" and "cancelled" in response.error.message
    finally:
        model.finalize()


async def _submit(model, params, sender):
    handles = model.engine.submit_many(params)
    model.loop.create_task(model._answer(handles, sender, "r1"))
    return handles


async def _results(handles):
    return await asyncio.gather(*(h.result() for h in handles))
