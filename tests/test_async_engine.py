"""The async front: submit/await, progress events, abort as a message, bounded queue, graceful shutdown."""

import asyncio

import pytest

from stepserve.async_engine import AsyncEngine, ShuttingDownError
from stepserve.engine import QueueFullError
from stepserve.executor.fake import FakeExecutor
from stepserve.types import RequestStatus, SamplingParams
from stepserve.validation import ValidationError


class SlowFake(FakeExecutor):
    """Takes real time per step, so that requests are in flight while the test acts."""

    def denoise(self, requests):
        import time

        time.sleep(0.005)
        return super().denoise(requests)


def run(coro):
    return asyncio.run(coro)


def test_submit_and_await_many():
    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="continuous", max_batch_size=4)
        await engine.start()
        handles = [engine.submit(SamplingParams(prompt="a", seed=i, num_inference_steps=3 + i % 4))
                   for i in range(20)]
        results = await asyncio.gather(*(h.result() for h in handles))
        await engine.shutdown(1.0)
        return results

    results = run(main())
    assert all(r.status is RequestStatus.COMPLETED for r in results)
    assert max(max(r.timing.batch_sizes) for r in results) > 1


def test_events_then_result_and_previews():
    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="continuous")
        await engine.start()
        h = engine.submit(SamplingParams(prompt="a", seed=1, num_inference_steps=5), preview_steps=frozenset({2}))
        items = [e async for e in h.events()]
        await engine.shutdown(1.0)
        return items

    items = run(main())
    steps = [e.step for e in items[:-1]]
    assert steps == [1, 2, 3, 4] and items[-1].status is RequestStatus.COMPLETED
    assert [e.preview is not None for e in items[:-1]] == [False, True, False, False]


def test_abort_cancels_and_frees_slot():
    async def main():
        engine = AsyncEngine(SlowFake(), strategy="continuous", max_batch_size=1)
        await engine.start()
        long = engine.submit(SamplingParams(prompt="a", seed=1, num_inference_steps=200))
        await asyncio.sleep(0.05)
        engine.abort(long.request_id)
        short = engine.submit(SamplingParams(prompt="b", seed=2, num_inference_steps=2))
        res = await asyncio.gather(long.result(), short.result())
        await engine.shutdown(1.0)
        return res, engine.running_count

    (long, short), running = run(main())
    assert long.status is RequestStatus.CANCELLED and short.status is RequestStatus.COMPLETED
    assert running == 0


def test_queue_bound_and_validation_raise_at_once():
    async def main():
        engine = AsyncEngine(SlowFake(), strategy="continuous", max_batch_size=1, max_queue=3)
        await engine.start()
        handles, rejected = [], 0
        for i in range(12):
            try:
                handles.append(engine.submit(SamplingParams(prompt="a", seed=i, num_inference_steps=20)))
            except QueueFullError:
                rejected += 1
        with pytest.raises(ValidationError):
            engine.submit(SamplingParams(prompt="", seed=1))
        results = await asyncio.gather(*(h.result() for h in handles))
        await engine.shutdown(1.0)
        return results, rejected

    results, rejected = run(main())
    assert rejected >= 8 and len(results) + rejected == 12
    assert all(r.status is RequestStatus.COMPLETED for r in results)


def test_shutdown_finishes_in_flight_and_refuses_new():
    async def main():
        engine = AsyncEngine(SlowFake(), strategy="continuous", max_batch_size=2)
        await engine.start()
        handles = [engine.submit(SamplingParams(prompt="a", seed=i, num_inference_steps=10)) for i in range(3)]
        stopping = asyncio.create_task(engine.shutdown(5.0))
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDownError):
            engine.submit(SamplingParams(prompt="b", seed=9))
        results = await asyncio.gather(*(h.result() for h in handles))
        await stopping
        return results

    assert all(r.status is RequestStatus.COMPLETED for r in run(main()))
