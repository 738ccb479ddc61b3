"""The async front: submit/await, progress events, abort as a message, bounded queue, graceful shutdown."""

import asyncio

import pytest

from stepserve.engine.async_engine import AsyncEngine, ShuttingDownError
from stepserve.costs import FakeExecutor
from stepserve.engine.admission_errors import QueueFullError
from stepserve.request.types import FinishReason, RequestStatus, SamplingParams
from stepserve.request.validation import ValidationError


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
        h = engine.submit(SamplingParams(prompt="a", seed=1, num_inference_steps=5), preview_steps=frozenset({2}),
                          stream=True)
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
        while engine.running_count < 1:  # it runs (and holds the one slot)
            await asyncio.sleep(0.005)
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
        ex = Gate()  # no step ends while the test submits: what is admitted does not depend on the machine's speed
        engine = AsyncEngine(ex, strategy="continuous", max_batch_size=1, max_queue=3)
        await engine.start()
        handles, rejected = [], 0
        for i in range(12):
            try:
                handles.append(engine.submit(SamplingParams(prompt="a", seed=i, num_inference_steps=20)))
            except QueueFullError:
                rejected += 1
        with pytest.raises(ValidationError):
            engine.submit(SamplingParams(prompt="", seed=1))
        ex.gate.set()
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
        stopping = asyncio.create_task(engine.shutdown(240.0))  # the grace bounds a hang only
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDownError):
            engine.submit(SamplingParams(prompt="b", seed=9))
        results = await asyncio.gather(*(h.result() for h in handles))
        await stopping
        return results

    assert all(r.status is RequestStatus.COMPLETED for r in run(main()))


class Gate(FakeExecutor):
    """Denoising blocks until the test opens the gate, so the test controls what is in flight."""

    def __init__(self):
        super().__init__()
        import threading

        self.gate = threading.Event()

    def denoise(self, requests):
        self.gate.wait(240)  # bounds a hang only
        return super().denoise(requests)


def test_submit_many_is_all_or_nothing():
    async def main():
        ex = Gate()
        engine = AsyncEngine(ex, strategy="continuous", max_batch_size=1, max_queue=4)
        await engine.start()
        first = engine.submit_many([SamplingParams(prompt="a", seed=i, num_inference_steps=2) for i in range(3)])
        depth_before = engine.queue_depth
        with pytest.raises(QueueFullError):
            engine.submit_many([SamplingParams(prompt="b", seed=i, num_inference_steps=2) for i in range(3)])
        depth_after = engine.queue_depth
        ex.gate.set()
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in first)), 10)
        await engine.shutdown(1.0)
        return depth_before, depth_after, results, engine.core.waiting

    before, after, results, waiting = run(main())
    assert after == before  # nothing of the refused group was queued
    assert all(r.status is RequestStatus.COMPLETED for r in results) and not waiting


def test_admission_has_no_window_between_inbox_and_queue():
    """The queue bound counts a request from submit until it leaves the waiting queue, with no gap while the
    engine thread moves it from its inbox into the core: so a full queue is refused at submit, never later."""
    import threading

    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="static", static_batch_size=100, max_queue=2)
        moving = threading.Event()
        proceed = threading.Event()
        real_enqueue = engine.core.enqueue

        def slow_enqueue(*args, **kwargs):
            moving.set()
            proceed.wait(0.3)  # holds the request between the inbox and the queue
            return real_enqueue(*args, **kwargs)

        engine.core.enqueue = slow_enqueue
        await engine.start()
        held = [engine.submit(SamplingParams(prompt="a", seed=i)) for i in range(2)]
        await asyncio.get_running_loop().run_in_executor(None, moving.wait, 240)
        refused_at_once = False
        try:
            late = engine.submit(SamplingParams(prompt="c", seed=5))
        except QueueFullError:
            refused_at_once, late = True, None
        proceed.set()
        await engine.shutdown(0.2)
        late_result = None if late is None else await late.result()
        return refused_at_once, late_result, held

    refused_at_once, late_result, _ = run(main())
    assert refused_at_once, f"accepted at submit, then ended as {late_result.finish_reason}"


def test_handles_are_only_touched_under_the_lock():
    class Guarded(dict):
        def __init__(self, lock):
            super().__init__()
            self.lock = lock
            self.unlocked = 0

        def _check(self):
            if not self.lock.locked():
                self.unlocked += 1

        def __setitem__(self, k, v):
            self._check()
            super().__setitem__(k, v)

        def pop(self, *args):
            self._check()
            return super().pop(*args)

        def __iter__(self):
            self._check()
            return super().__iter__()

    async def main():
        engine = AsyncEngine(SlowFake(), strategy="continuous", max_batch_size=2)
        engine._handles = guarded = Guarded(engine._lock)
        await engine.start()
        handles = [engine.submit(SamplingParams(prompt="a", seed=i, num_inference_steps=3)) for i in range(4)]
        engine.abort(handles[0].request_id)
        await asyncio.gather(*(h.result() for h in handles))
        await engine.shutdown(1.0)
        return guarded.unlocked

    assert run(main()) == 0


def test_progress_events_only_for_streaming_requests_and_bounded():
    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="continuous", max_batch_size=4)
        posted = []
        real_call = engine._call
        engine._call = lambda fn, *a: (posted.append(fn), real_call(fn, *a))[1]
        await engine.start()
        quiet = [engine.submit(SamplingParams(prompt="a", seed=i, num_inference_steps=30)) for i in range(3)]
        await asyncio.gather(*(h.result() for h in quiet))
        quiet_posts = len(posted)
        # a streaming request whose reader never reads: what is queued for it stays bounded
        loud = engine.submit(SamplingParams(prompt="b", seed=9, num_inference_steps=150), stream=True,
                             preview_steps=frozenset({75}))
        await loud.result()
        await asyncio.sleep(0.05)
        queued = loud._events.qsize()
        items = [e async for e in loud.events()]
        await engine.shutdown(1.0)
        return quiet_posts, queued, items

    quiet_posts, queued, items = run(main())
    assert quiet_posts <= 3  # one result per request, no per-step events
    assert queued <= 40
    assert any(getattr(e, "preview", None) is not None for e in items)  # previews are never dropped
    assert items[-1].status is RequestStatus.COMPLETED


def test_events_need_a_streaming_submit():
    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="continuous")
        await engine.start()
        h = engine.submit(SamplingParams(prompt="a", seed=1, num_inference_steps=2))
        with pytest.raises(RuntimeError, match="stream=True"):
            async for _ in h.events():
                pass
        await h.result()
        await engine.shutdown(1.0)

    run(main())


def test_expired_request_fails_at_its_deadline_not_at_the_next_batch():
    async def main():
        # dynamic batching waits 30 s for a fuller batch; the request's own deadline is 0.2 s
        engine = AsyncEngine(FakeExecutor(), strategy="dynamic", max_batch_size=8, max_queue_delay_ms=30_000)
        await engine.start()
        h = engine.submit(SamplingParams(prompt="a", seed=1, timeout_s=0.2))
        result = await asyncio.wait_for(h.result(), 20.0)  # well before the 30 s batching wait
        await engine.shutdown(0.0)
        return result

    result = run(main())
    assert result.finish_reason is FinishReason.TIMEOUT and "queued" in result.error


def test_a_costly_admission_decision_runs_off_the_event_loop():
    """slo's admission replays the queue (its cost grows with the queue): the server submits through
    submit_many_off_loop, so the event loop keeps serving while a decision is being made."""
    import threading

    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="slo", max_batch_size=2)
        await engine.start()
        release, deciding = threading.Event(), threading.Event()

        def slow_admission(request, waiting, running, now):  # stands for the replay of a long queue
            deciding.set()
            release.wait(240)
            return None

        engine.core.policy.admission = slow_admission
        submit = asyncio.ensure_future(engine.submit_many_off_loop([SamplingParams(prompt="a", timeout_s=60)]))
        ticks = 0
        while not deciding.is_set() or ticks < 5:  # the loop runs other coroutines while the decision is pending
            await asyncio.sleep(0.01)
            ticks += 1
        assert not submit.done()
        release.set()
        [handle] = await submit
        assert (await handle.result()).ok
        await engine.shutdown(1.0)

    run(main())
