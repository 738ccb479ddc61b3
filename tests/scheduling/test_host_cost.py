"""A step's work does not grow with the queue: counted in attribute reads of waiting requests, not in seconds."""

import gc
import weakref

import pytest

from stepserve.costs import FakeExecutor
from stepserve.engine.core import EngineCore
from stepserve.scheduling import make_policy
from stepserve.scheduling.queue import WaitingQueue, as_queue
from stepserve.request.types import Request, RequestStatus, SamplingParams


class _Reads:
    on = False
    n = 0


class Watched(Request):
    """A request that counts every attribute read while _Reads.on (engine and policy alike)."""

    def __getattribute__(self, name):
        if _Reads.on:
            _Reads.n += 1
        return object.__getattribute__(self, name)


def _params(i: int) -> SamplingParams:
    size = 16 if i % 2 else 32
    return SamplingParams(prompt=f"p{i}", seed=i, num_inference_steps=(2, 5, 9)[i % 3], height=size, width=size,
                          timeout_s=1e6 if i % 4 < 2 else None)


def reads_per_step(strategy: str, depth: int, steps: int = 60, admit: bool = True) -> list[int]:
    """Attribute reads of requests per step, the queue topped up to `depth` before each (`admit` False: queued
    without the admission rule, whose prediction reads the queue once per arrival, outside the step)."""
    core = EngineCore(FakeExecutor(), make_policy(strategy, max_batch_size=4, max_queue_delay_ms=5.0,
                                                  static_flush_timeout_s=0.05))
    n, now, counts = 0, 0.0, []
    for _ in range(steps):
        while len(core.waiting) < depth:
            if admit:
                core.add_request(_params(n), now).__class__ = Watched
            else:
                request = core.new_request(_params(n), now)
                request.__class__ = Watched
                core.enqueue(request)
            n += 1
        _Reads.n, _Reads.on = 0, True
        try:
            report = core.step(now)
        finally:
            _Reads.on = False
        counts.append(_Reads.n)
        now += max(report.duration_s, 0.01)
    return counts


@pytest.mark.parametrize("strategy", ["continuous", "dynamic", "static", "none"])
def test_step_reads_the_same_requests_at_any_queue_depth(strategy):
    shallow, deep = reads_per_step(strategy, 200), reads_per_step(strategy, 3000)
    assert deep == shallow  # the same decisions, and not one more request looked at
    assert sum(shallow) > 0 and max(shallow) < 400  # a few requests per step, not the queue


def test_slo_with_deadlines_reads_no_more_requests_per_step_at_any_queue_depth():
    """Half the requests carry a deadline: the slo step reads its queue through indexes (scheduling/slo_index.py),
    built once on the first step, so later steps read about the same few requests at 3000 queued as at 200 (a
    scan read all of them: thousands per step)."""
    shallow, deep = reads_per_step("slo", 200, 30, admit=False), reads_per_step("slo", 3000, 30, admit=False)
    assert max(deep[1:]) < 400 and max(deep[1:]) <= 1.5 * max(shallow[1:])
    assert sum(shallow[1:]) > 0


def test_waiting_queue_indexes_buckets_by_age_and_keeps_arrival_order():
    def req(i, bucket):
        return Request(request_id=f"r{i}", params=None, arrival_time=float(i), bucket=bucket,
                       num_inference_steps=1)

    a, b, c, d = req(0, (32, 32)), req(1, (16, 16)), req(2, (32, 32)), req(3, (16, 16))
    q = WaitingQueue([a, b, c, d])
    assert list(q) == [a, b, c, d] and q.buckets() == [(32, 32), (16, 16)]
    assert q.head((32, 32)) == [a, c] and q.head((16, 16), 1) == [b] and q.count((16, 16)) == 2
    q.remove(a)
    assert q.buckets() == [(16, 16), (32, 32)] and list(q) == [b, c, d]
    assert q.discard(c) and not q.discard(c) and q.buckets() == [(16, 16)] and q.head((32, 32)) == []
    assert as_queue(q) is q and list(as_queue([d, b])) == [d, b]
    with pytest.raises(ValueError):
        q.append(b)


def test_ended_requests_are_not_held_by_the_deadline_heap_and_expire_in_order():
    core = EngineCore(FakeExecutor(), make_policy("static", max_batch_size=8, static_flush_timeout_s=None))
    early = [core.add_request(SamplingParams(prompt="x", seed=i, num_inference_steps=2, timeout_s=1.0 + i), 0.0)
             for i in range(3)]
    late = core.add_request(SamplingParams(prompt="y", seed=9, num_inference_steps=2, timeout_s=5.0), 0.0)
    assert core.step(0.5).wake_at == 1.0  # idle: wakes for the earliest deadline
    rep = core.step(2.5)  # the first two expired, in arrival order
    assert rep.finished == early[:2] and all(r.status is RequestStatus.FAILED for r in early[:2])
    assert core.cancel_now([late.request_id], 2.6) == [late]
    assert core.step(2.9).wake_at == 3.0 and list(core.waiting) == [early[2]]  # the cancelled one's entry skipped
    ref = weakref.ref(late)
    del late, rep
    gc.collect()
    assert ref() is None  # the heap's entry does not keep an ended request (and its image) alive
