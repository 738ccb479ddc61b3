"""The runner stops when the server stops, whatever its loop was doing: a wake that lands as close() cancels the
loop (a job ending during shutdown wakes it) must not keep the loop running. Python 3.11's asyncio.wait_for
returns the awaited result instead of raising when the cancellation and the result arrive together, so the loop
went round again, forever, and the app's shutdown never ended."""

from __future__ import annotations

import asyncio

from stepserve.costs import FakeExecutor
from stepserve.engine.async_engine import AsyncEngine
from stepserve.jobs.runner import JobRunner
from stepserve.store.memory import MemoryStore
from stepserve.store.results import Results

HANG_S = 60.0  # bounds a hang only


def test_a_wake_as_the_runner_closes_does_not_keep_its_loop_going():
    async def main() -> None:
        engine = AsyncEngine(FakeExecutor(), strategy="continuous")
        await engine.start()
        results = Results.in_temporary_folder()
        try:
            for _ in range(5):
                runner = JobRunner(engine, MemoryStore(), results, "a", {}, service="s", max_running=1, poll_s=3600)
                runner.start()
                while not any(f.f_code.co_name == "wait_for" for f in runner._loop_task.get_stack(limit=50)) and \
                        "wait_for" not in repr(runner._loop_task):
                    await asyncio.sleep(0.01)  # until the loop waits for a wake
                runner.wake()  # the wait ends ...
                await asyncio.wait_for(runner.close(), HANG_S)  # ... as the loop is cancelled
                assert runner._loop_task.done()
        finally:
            results.close()
            await engine.shutdown(1.0)

    asyncio.run(main())
