"""The engine thread under faults: a failing policy, callback or core never leaves a caller waiting forever.

Each test bounds its waits (asyncio.wait_for) so that a regression fails instead of hanging the suite.
"""

import asyncio
import logging
import threading

import pytest

from stepserve.engine.async_engine import AsyncEngine, EngineDeadError
from stepserve.costs import FakeExecutor
from stepserve.request.types import FinishReason, RequestStatus, SamplingParams

WAIT_S = 120.0  # generous: the engine answers these in milliseconds; this only stops a hang


def run(coro):
    return asyncio.run(coro)


def params(i: int, steps: int = 4) -> SamplingParams:
    return SamplingParams(prompt="a", seed=i, num_inference_steps=steps)


class FlakyPolicy:
    """Wraps a real policy; raises on the calls listed in `fail_on` (1-based), delegates otherwise."""

    def __init__(self, inner, fail_on: set[int]) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_batch_size = inner.max_batch_size
        self.fail_on = fail_on
        self.calls = 0

    def schedule(self, waiting, running, now, draining=False):
        self.calls += 1
        if self.calls in self.fail_on:
            raise ZeroDivisionError("injected policy fault")
        return self.inner.schedule(waiting, running, now, draining=draining)


def test_failing_policy_fails_its_requests_with_a_clear_error_and_keeps_serving():
    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="continuous", max_batch_size=4)
        engine.core.policy = FlakyPolicy(engine.core.policy, fail_on={3})
        await engine.start()
        first = [engine.submit(params(i, steps=6)) for i in range(3)]
        failed = await asyncio.wait_for(asyncio.gather(*(h.result() for h in first)), WAIT_S)
        later = engine.submit(params(9))  # the core is intact: the next request is served
        ok = await asyncio.wait_for(later.result(), WAIT_S)
        await engine.shutdown(1.0)
        return failed, ok, engine.healthy

    failed, ok, healthy = run(main())
    assert all(r.status is RequestStatus.FAILED and r.finish_reason is FinishReason.ERROR for r in failed)
    assert all("batching policy" in r.error and "ZeroDivisionError" in r.error for r in failed)
    assert ok.status is RequestStatus.COMPLETED
    assert healthy


def test_failing_step_callback_is_logged_and_requests_still_complete(caplog):
    def broken(report):
        raise KeyError("injected callback fault")

    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="continuous", max_batch_size=4)
        engine.on_step.append(broken)
        await engine.start()
        handles = [engine.submit(params(i)) for i in range(5)]
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), WAIT_S)
        await engine.shutdown(1.0)
        return results, engine.healthy

    with caplog.at_level(logging.ERROR, logger="stepserve.engine.async_engine"):
        results, healthy = run(main())
    assert all(r.status is RequestStatus.COMPLETED for r in results)
    assert healthy
    callback_logs = [rec for rec in caplog.records if "on_step callback" in rec.getMessage()]
    assert len(callback_logs) == 1  # once per failing callback, not once per step


def test_broken_core_fails_everything_pending_and_reports_unhealthy():
    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="continuous", max_batch_size=2)
        real_step = engine.core.step
        calls = {"n": 0}

        def step(now):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected core fault")
            return real_step(now)

        engine.core.step = step
        await engine.start()
        handles = [engine.submit(params(i, steps=5)) for i in range(4)]
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), WAIT_S)
        with pytest.raises(EngineDeadError, match="injected core fault"):
            engine.submit(params(7))
        healthy, failure = engine.healthy, engine.failure
        await asyncio.wait_for(engine.shutdown(1.0), WAIT_S)
        return results, healthy, failure

    results, healthy, failure = run(main())
    assert all(r.status is RequestStatus.FAILED and r.finish_reason is FinishReason.ERROR for r in results)
    assert all("injected core fault" in r.error for r in results)
    assert not healthy and "RuntimeError" in failure


def test_shutdown_says_when_the_engine_thread_did_not_stop(caplog):
    release, stuck = threading.Event(), threading.Event()

    class Stuck(FakeExecutor):
        def denoise(self, requests):
            stuck.set()
            release.wait(240)
            return super().denoise(requests)

    async def main():
        engine = AsyncEngine(Stuck(), strategy="continuous", join_timeout_s=0.2)
        await engine.start()
        engine.submit(params(1, steps=1))
        assert await asyncio.to_thread(stuck.wait, WAIT_S), "the step never started"
        stopped = await asyncio.wait_for(engine.shutdown(0.0), WAIT_S)
        release.set()
        return stopped

    with caplog.at_level(logging.WARNING, logger="stepserve.engine.async_engine"):
        stopped = run(main())
    assert stopped is False
    assert any("did not stop" in rec.getMessage() for rec in caplog.records)


def test_shutdown_during_a_step_longer_than_the_join_timeout_answers_every_pending_request():
    """Running, queued and streaming requests all get their result (shut down: CANCELLED, which the server sends
    as its documented 503), although the stuck step never ends within the shutdown."""
    release, stuck = threading.Event(), threading.Event()

    class Stuck(FakeExecutor):
        def denoise(self, requests):
            stuck.set()
            release.wait(240)
            return super().denoise(requests)

    async def main():
        engine = AsyncEngine(Stuck(), strategy="continuous", max_batch_size=2, join_timeout_s=0.2)
        await engine.start()
        handles = [engine.submit(params(i, steps=3)) for i in range(4)]  # two in the stuck step, two queued
        stream = engine.submit(params(9, steps=3), stream=True)
        assert await asyncio.to_thread(stuck.wait, WAIT_S), "the step never started"
        stopped = await asyncio.wait_for(engine.shutdown(0.0), WAIT_S)
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles + [stream])), WAIT_S)
        events = [e async for e in stream.events()]
        release.set()
        await asyncio.sleep(0.05)  # the step ends late: its report finds no handle to answer twice
        return stopped, results, events

    stopped, results, events = run(main())
    assert stopped is False
    assert [(r.status, r.finish_reason) for r in results] == [(RequestStatus.CANCELLED, FinishReason.ABORTED)] * 5
    assert all("shut down" in r.error for r in results)
    assert events[-1].status is RequestStatus.CANCELLED


def test_failing_preview_is_logged_once_and_the_stream_goes_on(caplog):
    class NoPreview(FakeExecutor):
        def preview(self, request):
            raise ValueError("injected preview fault")

    async def main():
        engine = AsyncEngine(NoPreview(), strategy="continuous")
        await engine.start()
        handles = [engine.submit(params(i, steps=6), preview_steps=frozenset({2, 4}), stream=True)
                   for i in range(3)]
        streams = []
        for h in handles:
            streams.append([e async for e in h.events()])
        await engine.shutdown(1.0)
        return streams

    with caplog.at_level(logging.WARNING, logger="stepserve.engine.async_engine"):
        streams = run(main())
    assert all(s[-1].status is RequestStatus.COMPLETED for s in streams)
    assert all(e.preview is None for s in streams for e in s[:-1])
    assert sum("preview failed" in rec.getMessage() for rec in caplog.records) == 1


def test_executor_failure_is_logged_once_per_stage_and_kind(caplog):
    from stepserve.engine.core import EngineCore
    from stepserve.scheduling import make_policy
    from stepserve.sim import Arrival, simulate

    core = EngineCore(FakeExecutor(fault=lambda stage, requests: stage == "decode"), make_policy("continuous"))
    with caplog.at_level(logging.ERROR, logger="stepserve.engine.core"):
        result = simulate(core, [Arrival(0.01 * i, params(i, steps=2)) for i in range(6)])
    assert all(r.finish_reason is FinishReason.ERROR for r in result.requests)
    assert sum("executor decode failed" in rec.getMessage() for rec in caplog.records) == 1


def test_a_draining_engine_refuses_before_loading_any_add_on():
    """A request sent while the engine drains is refused at once: its ControlNets and IP-Adapters (gigabytes) are
    not loaded for a request that would then be refused."""
    from stepserve.engine.handles import ShuttingDownError

    async def main():
        engine = AsyncEngine(FakeExecutor(), strategy="continuous", max_batch_size=2)
        loaded = []

        async def preload(p):
            loaded.append(p)

        engine.preload_addons = preload
        await engine.start()
        engine.accepting = False  # as shutdown() begins
        with pytest.raises(ShuttingDownError):
            await asyncio.wait_for(engine.submit_many_off_loop([params(1)]), WAIT_S)
        engine.accepting = True
        await engine.shutdown(1.0)
        return loaded

    assert run(main()) == []
