"""Cancelled means aborted: when the task waiting for a non-streaming request's results is cancelled (Ray Serve
cancels it when the client goes away, uvicorn at shutdown), the engine requests are aborted and their slots free
up by the next step, as when the client hangs up."""

from __future__ import annotations

import asyncio
import time

from stepserve.engine.async_engine import AsyncEngine
from stepserve.costs import FakeExecutor
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
