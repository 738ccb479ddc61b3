"""Cancelled means aborted: when the task waiting for a non-streaming request's results is cancelled (Ray Serve
cancels it when the client goes away, uvicorn at shutdown), the engine requests are aborted and their slots free
up by the next step, as when the client hangs up; a handler cancelled during its admission leaves nothing running
either, and is recorded once."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import httpx
import pytest

from stepserve.engine.async_engine import AsyncEngine
from stepserve.costs import FakeExecutor
from stepserve.costs.fake import FAKE_MODEL
from stepserve.server.app import create_app
from stepserve.server.images import wait_all
from stepserve.server.state import ServerState
from stepserve.server.metrics import ServerMetrics
from stepserve.server.schemas import ServerLimits
from stepserve.request.types import FinishReason, RequestStatus, SamplingParams


class SlowSteps(FakeExecutor):
    def denoise(self, requests):
        time.sleep(0.01)
        return super().denoise(requests)


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def test_cancelling_the_waiting_task_aborts_its_requests():
    async def main():
        engine = AsyncEngine(SlowSteps(), strategy="continuous", max_batch_size=2)
        await engine.start()
        state = ServerState(engine, ServerLimits(), ServerMetrics(engine))
        handles = engine.submit_many([SamplingParams(prompt="long", seed=i, num_inference_steps=200)
                                      for i in range(2)])
        waiting = asyncio.ensure_future(wait_all(state, handles, _never_disconnects, None))
        while engine.running_count < 2:
            await asyncio.sleep(0.01)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            pass
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 120)  # bounds a hang
        # the freed slots take the next request at once
        after = engine.submit(SamplingParams(prompt="next", seed=9, num_inference_steps=2))
        last = await asyncio.wait_for(after.result(), 120)
        await engine.shutdown(1.0)
        return results, last

    results, last = asyncio.run(main())
    assert [(r.status, r.finish_reason) for r in results] == [(RequestStatus.CANCELLED, FinishReason.ABORTED)] * 2
    assert all(len(r.timing.batch_sizes) < 200 for r in results)
    assert last.status is RequestStatus.COMPLETED


@pytest.mark.parametrize("path,series", [
    ("/v1/images/generations", 'stepserve_requests_total{outcome="cancelled"}'),
], ids=["images"])
def test_a_handler_cancelled_during_admission_leaves_no_request_running(path, series):
    """A handler cancelled while its admission is being decided off the event loop (slo) gets no request run for
    it: what the decision accepted after the cancellation is aborted, the engine's queue and running set empty
    again, and the request is recorded once, as cancelled. (A video's POST admits nothing: it stores a job, which
    a runner submits later; tests/jobs.)"""
    video_model = replace(FAKE_MODEL, max_frames=33, frame_step=4, default_frames=9)

    async def main():
        engine = AsyncEngine(SlowSteps(video_model), strategy="slo", max_batch_size=2)
        app = create_app(engine)
        await engine.start()
        release, deciding = threading.Event(), threading.Event()

        def slow_admission(request, waiting, running, now):  # a decision still under way when the handler goes
            deciding.set()
            release.wait(60)
            return None

        engine.core.policy.admission = slow_admission
        ended = []
        engine.on_step.append(lambda report: ended.extend(report.finished))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://stepserve") as client:
            post = asyncio.ensure_future(client.post(path, json={"prompt": "long", "num_inference_steps": 200}))
            while not deciding.is_set():
                await asyncio.sleep(0.01)
            post.cancel()
            release.set()  # the decision goes on after the cancellation, and accepts the request
            with pytest.raises(asyncio.CancelledError):
                await post
            while not ended:
                await asyncio.sleep(0.01)
            idle = (engine.queue_depth, engine.running_count)
            metrics = app.state.server.metrics.render().decode()
        await engine.shutdown(1.0)
        return ended, idle, metrics

    ended, idle, metrics = asyncio.run(main())
    assert [(r.status, r.finish_reason) for r in ended] == [(RequestStatus.CANCELLED, FinishReason.ABORTED)]
    assert idle == (0, 0)
    counted = [line for line in metrics.splitlines() if line.startswith(series + " ")]
    assert counted == [series + " 1.0"], metrics
