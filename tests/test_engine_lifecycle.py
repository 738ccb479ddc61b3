"""Nothing lost: arrivals, aborts, deadlines and executor faults always end in exactly one final state."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nothing_lost import assert_nothing_lost, every_nth_call_fails

from stepserve.costs import FakeExecutor
from stepserve.engine.admission_errors import QueueFullError
from stepserve.engine.core import EngineCore
from stepserve.scheduling import STRATEGIES, make_policy
from stepserve.sim import Arrival
from stepserve.request.types import FinishReason, RequestStatus, SamplingParams

arrival = st.builds(
    lambda t, steps, g, size, timeout, abort: (t, steps, g, size, timeout, abort),
    st.floats(0, 2.0),
    st.integers(1, 12),
    st.sampled_from([1.0, 4.0]),
    st.sampled_from([16, 32]),
    st.one_of(st.none(), st.floats(0.01, 1.0)),
    st.one_of(st.none(), st.floats(0.0, 2.5)),
)


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=25),
    strategy=st.sampled_from(STRATEGIES),
    max_batch=st.integers(1, 5),
    max_queue=st.one_of(st.none(), st.integers(1, 6)),
    fault_every=st.one_of(st.none(), st.integers(2, 9)),
    max_decode=st.one_of(st.none(), st.integers(1, 3)),
)
def test_every_request_ends_in_exactly_one_final_state(arrivals, strategy, max_batch, max_queue, fault_every,
                                                       max_decode):
    core = EngineCore(FakeExecutor(fault=every_nth_call_fails(fault_every)), make_policy(strategy, max_batch, 20.0),
                      max_queue, max_decode)
    trace = [
        Arrival(t, SamplingParams(prompt=f"p{i}", seed=i, num_inference_steps=steps, guidance_scale=g,
                                  height=size, width=size, timeout_s=timeout), abort_at=abort)
        for i, (t, steps, g, size, timeout, abort) in enumerate(arrivals)
    ]
    assert_nothing_lost(core, trace)


def test_fault_fails_only_requests_in_that_step_and_engine_keeps_serving():
    bad_seed = 7
    core = EngineCore(FakeExecutor(fault=lambda stage, reqs: stage == "denoise" and any(
        r.params.seed == bad_seed for r in reqs)), make_policy("continuous", 4))
    a = core.add_request(SamplingParams(prompt="a", seed=1, num_inference_steps=3), 0.0)
    rep = core.step(0.0)
    bad = core.add_request(SamplingParams(prompt="b", seed=bad_seed, num_inference_steps=3), 1.0)
    rep = core.step(1.0)
    # the batch is retried in halves: only the culprit fails, its batch-mate takes its step
    assert {r.request_id for r in rep.finished} == {bad.request_id} and rep.progressed == [a]
    assert bad.status is RequestStatus.FAILED and "injected denoise fault" in bad.error
    core.step(1.5)
    assert a.status is RequestStatus.COMPLETED
    c = core.add_request(SamplingParams(prompt="c", seed=2, num_inference_steps=2), 2.0)
    core.step(2.0)
    core.step(3.0)
    assert c.status is RequestStatus.COMPLETED


def test_abort_frees_the_slot_by_the_next_step():
    core = EngineCore(FakeExecutor(), make_policy("continuous", 1))
    a = core.add_request(SamplingParams(prompt="a", seed=1, num_inference_steps=50), 0.0)
    b = core.add_request(SamplingParams(prompt="b", seed=2, num_inference_steps=2), 0.0)
    core.step(0.0)
    core.abort(a.request_id)
    rep = core.step(1.0)
    assert a.status is RequestStatus.CANCELLED and a.finish_reason is FinishReason.ABORTED
    assert rep.admitted == [b]


def test_deadline_fails_with_reason_and_frees_slot():
    core = EngineCore(FakeExecutor(), make_policy("continuous", 1))
    a = core.add_request(SamplingParams(prompt="a", seed=1, num_inference_steps=50, timeout_s=0.5), 0.0)
    core.step(0.0)
    rep = core.step(0.6)
    assert a.status is RequestStatus.FAILED and a.finish_reason is FinishReason.TIMEOUT
    assert "deadline" in a.error and a in rep.finished and not core.running


def test_full_queue_rejects_at_once_with_a_distinct_error():
    core = EngineCore(FakeExecutor(), make_policy("continuous", 1), max_queue=2)
    for i in range(2):
        core.add_request(SamplingParams(prompt="a", seed=i), 0.0)
    with pytest.raises(QueueFullError, match="queue is full") as info:
        core.add_request(SamplingParams(prompt="a", seed=9), 0.0)
    assert info.value.request.status is RequestStatus.REJECTED
    assert info.value.request in core.step(0.0).finished


@pytest.mark.parametrize("strategy", ["static", "dynamic"])
def test_a_waiting_deadline_is_a_wake_up_time(strategy):
    """A policy that waits (for a fuller batch) must not sleep past a waiting request's deadline."""
    core = EngineCore(FakeExecutor(), make_policy(strategy, max_batch_size=8, max_queue_delay_ms=60_000,
                                                  static_batch_size=8))
    core.add_request(SamplingParams(prompt="a", seed=1, timeout_s=0.5), now=0.0)
    report = core.step(0.0)
    assert report.batch_size == 0 and report.wake_at == pytest.approx(0.5)
    expired = core.step(report.wake_at)
    assert [r.finish_reason for r in expired.finished] == [FinishReason.TIMEOUT]


def test_an_image_finished_after_its_deadline_is_a_timeout_not_an_answer():
    from stepserve.costs import CostModel

    # the deadline falls inside the decode of the last step: the image exists, but too late
    core = EngineCore(FakeExecutor(cost=CostModel(decode_fixed_s=0.5)), make_policy("continuous"))
    r = core.add_request(SamplingParams(prompt="a", seed=1, num_inference_steps=1, timeout_s=0.1), now=0.0)
    report = core.step(0.0)
    assert report.finished == [r] and r.finish_reason is FinishReason.TIMEOUT
    assert r.image is None and "ms too late" in r.error


def test_decodes_are_bounded_per_step_and_slots_free_at_once():
    """With max_decode_per_step=1, four requests that finish denoising together are decoded over four steps,
    while the freed slots already take new requests."""
    ex = FakeExecutor()
    core = EngineCore(ex, make_policy("continuous", max_batch_size=4), max_decode_per_step=1)
    first = [core.add_request(SamplingParams(prompt="a", seed=i, num_inference_steps=2), 0.0) for i in range(4)]
    later = [core.add_request(SamplingParams(prompt="b", seed=10 + i, num_inference_steps=3), 0.0) for i in range(4)]
    decoded_per_step, t = [], 0.0
    while core.has_work():
        report = core.step(t)
        t += report.duration_s
        decoded_per_step.append(sum(1 for r in report.finished if r.status is RequestStatus.COMPLETED))
    assert max(decoded_per_step) == 1 and sum(decoded_per_step) == 8
    assert all(r.status is RequestStatus.COMPLETED for r in first + later)
    assert ex.forward_batch_sizes[:3] == [4, 4, 4]  # step 3: the later four run while the first four decode


def test_answer_margin_moves_the_engine_deadline_earlier():
    core = EngineCore(FakeExecutor(), make_policy("continuous"), answer_margin_s=0.01)
    r = core.add_request(SamplingParams(prompt="a", seed=1, timeout_s=0.5), now=2.0)
    assert r.deadline == pytest.approx(2.49)
    with pytest.raises(ValueError, match="answer_margin_s"):
        EngineCore(FakeExecutor(), make_policy("continuous"), answer_margin_s=-1.0)
