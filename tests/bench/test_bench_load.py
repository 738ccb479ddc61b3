"""The open-loop sender keeps its schedule whatever the target does; latency runs from the scheduled time."""

import asyncio
import statistics

from stepserve.bench.load import run_closed_loop, run_open_loop
from stepserve.bench.targets import OK, UNFINISHED, Reply
from stepserve.bench.workload import Mix, RequestSpec, Trace, TraceItem, user_requests


class SlowTarget:
    """Answers after `delay_s`, and remembers when each call arrived (on the loop's clock)."""

    name = "slow"

    def __init__(self, delay_s):
        self.delay_s = delay_s
        self.calls = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.cancelled = 0

    async def send(self, spec):
        self.calls.append(asyncio.get_running_loop().time())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1
        return Reply(OK)


def trace_of(offsets):
    return Trace([TraceItem(t, RequestSpec("p", i)) for i, t in enumerate(offsets)], "test")


def test_slow_target_does_not_delay_sends():
    offsets = [i * 0.01 for i in range(30)]  # one send every 10 ms; each answer takes 300 ms
    target = SlowTarget(0.3)
    result = asyncio.run(run_open_loop(target, trace_of(offsets), warmup_s=0.0, drain_s=5.0))
    lags = [o.sent_s - o.scheduled_s for o in result.outcomes]
    assert all(-0.001 <= lag < 0.03 for lag in lags), lags  # noisy shared machine: a generous ceiling
    assert statistics.median(lags) < 0.005
    assert target.max_in_flight > 20  # the sender never waited for answers
    # the target saw the calls on schedule too (same clock as the run's start)
    assert all(abs((c - result.start) - t) < 0.03 for c, t in zip(target.calls, offsets))


def test_latency_runs_from_the_scheduled_send_time():
    target = SlowTarget(0.05)
    result = asyncio.run(run_open_loop(target, trace_of([0.0, 0.02, 0.04]), warmup_s=0.0, drain_s=5.0))
    for o in result.outcomes:
        assert o.status == OK
        assert o.latency_s == o.done_s - o.scheduled_s
        assert o.latency_s >= 0.05 - 1e-3
        assert o.latency_s >= o.done_s - o.sent_s  # never the shorter, send-based figure


def test_late_sends_still_count_from_the_schedule():
    """If the sender itself is held up (a blocked loop), the delay lands in the latency, not hidden."""
    import time

    class Blocking(SlowTarget):
        async def send(self, spec):
            if spec.seed == 0:
                time.sleep(0.1)  # blocks the event loop: the next send goes out late
            return await super().send(spec)

    result = asyncio.run(run_open_loop(Blocking(0.01), trace_of([0.0, 0.01]), warmup_s=0.0, drain_s=5.0))
    late = result.outcomes[1]
    assert late.sent_s - late.scheduled_s > 0.05
    assert late.latency_s >= (late.sent_s - late.scheduled_s) + 0.01 - 1e-3


def test_warmup_excluded_and_unfinished_cancelled_at_the_drain_limit():
    target = SlowTarget(10.0)
    result = asyncio.run(run_open_loop(target, trace_of([0.0, 0.05, 0.1]), warmup_s=0.04, drain_s=0.1))
    assert [o.warmup for o in result.outcomes] == [True, False, False]
    assert len(result.measured) == 2
    assert all(o.status == UNFINISHED and o.latency_s is None for o in result.outcomes)
    assert target.cancelled == 3  # the target was told, so an engine can free the slots
    assert (result.window_start_s, result.window_end_s) == (0.04, 0.1)


def test_closed_loop_users_wait_for_their_answer_and_are_labelled():
    target = SlowTarget(0.05)
    users = [user_requests(Mix.from_steps([4, 8]), seed=1, user=u) for u in range(3)]
    result = asyncio.run(run_closed_loop(target, users, warmup_s=0.1, duration_s=0.3, drain_s=1.0))
    assert result.mode == "closed-loop" and "closed-loop" in result.description
    assert target.max_in_flight <= 3
    # each user sends again once answered: at most one per 50 ms each (0.4 s), and more than one each however
    # late a busy machine wakes the loop
    assert 3 * 2 <= len(result.outcomes) <= 3 * 9
    assert any(o.warmup for o in result.outcomes) and result.measured
    assert all(o.status == OK for o in result.outcomes)
