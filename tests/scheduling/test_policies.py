"""Each policy keeps its promise, checked on a simulated clock with the fake executor."""

import random

import pytest

from stepserve.costs import CostModel, FakeExecutor, LatencyModel
from stepserve.engine.core import EngineCore
from stepserve.scheduling import (
    ContinuousBatchingPolicy,
    DynamicBatchingPolicy,
    NoBatchingPolicy,
    StaticBatchingPolicy,
    make_policy,
)
from stepserve.sim import Arrival, simulate
from stepserve.request.types import RequestStatus, SamplingParams


def poisson_trace(seed, n=60, rate=40.0, sizes=((32, 32),), steps=(4, 10, 20)):
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        h, w = rng.choice(sizes)
        out.append(Arrival(t, SamplingParams(prompt=f"p{i}", seed=i, num_inference_steps=rng.choice(steps),
                                             guidance_scale=rng.choice([1.0, 3.0]), height=h, width=w)))
    return out


def run(policy, trace):
    core = EngineCore(FakeExecutor(), policy)
    res = simulate(core, trace)
    assert all(r.status is RequestStatus.COMPLETED for r in res.requests)
    return core, res


@pytest.mark.parametrize("seed", range(5))
def test_none_runs_one_request_at_a_time(seed):
    _, res = run(NoBatchingPolicy(), poisson_trace(seed))
    assert {s.batch_size for s in res.steps if s.batch_size} == {1}
    # start to finish: a request's steps are consecutive engine steps
    order = [s.progressed[0].request_id for s in res.steps if s.batch_size]
    seen_done = set()
    for prev, cur in zip(order, order[1:]):
        if prev != cur:
            assert cur not in seen_done
            seen_done.add(prev)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [2, 4])
def test_static_runs_only_full_batches_except_flush(seed, n):
    flush = 0.5
    _, res = run(StaticBatchingPolicy(n, flush_timeout_s=flush), poisson_trace(seed, rate=20.0))
    formed = [s for s in res.steps if s.admitted]
    assert formed
    for s in formed:
        oldest = min(r.arrival_time for r in s.admitted)
        assert len(s.admitted) == n or s.now - oldest >= flush - 1e-9, (len(s.admitted), s.now - oldest)
        assert len(s.admitted) <= n


def test_static_never_flushes_without_timeout_and_draining_flushes():
    core = EngineCore(FakeExecutor(), StaticBatchingPolicy(4, flush_timeout_s=None))
    reqs = [core.add_request(SamplingParams(prompt="a", seed=i, num_inference_steps=2), 0.0) for i in range(3)]
    for t in range(100):
        rep = core.step(float(t))
        assert rep.batch_size == 0 and rep.wake_at is None
    core.draining = True
    rep = core.step(100.0)
    assert rep.batch_size == 3 and all(r.status is RequestStatus.RUNNING for r in reqs)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.2])
def test_dynamic_never_waits_past_delay_nor_exceeds_max_batch(seed, delay):
    max_batch = 4
    _, res = run(DynamicBatchingPolicy(max_batch, delay), poisson_trace(seed, rate=30.0))
    busy_until = 0.0
    for s in res.steps:
        assert s.batch_size <= max_batch
        if s.admitted:
            oldest = min(r.arrival_time for r in s.admitted)
            # it starts as soon as the delay passed, or as soon as the previous batch let go of the engine
            assert s.now <= max(oldest + delay, busy_until) + 1e-9
            assert len(s.admitted) == max_batch or s.now >= oldest + delay - 1e-9
        if s.batch_size:
            busy_until = s.now + s.duration_s


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_continuous_never_leaves_a_slot_idle_while_a_compatible_request_waits(seed, max_batch):
    trace = poisson_trace(seed, rate=60.0, sizes=((32, 32), (16, 16)))
    _, res = run(ContinuousBatchingPolicy(max_batch), trace)
    for s in res.steps:
        if not s.batch_size:
            continue
        assert s.batch_size <= max_batch
        bucket = s.progressed[0].bucket
        assert all(r.bucket == bucket for r in s.progressed)
        # slots are counted over all buckets: the requests holding one (admitted, not done denoising)
        resident = [r for r in res.requests if r.timing.admitted <= s.now < r.timing.denoise_done]
        assert len(resident) <= max_batch
        if len(resident) < max_batch:
            left_waiting = [r for r in res.requests if r.bucket == bucket and r.arrival_time <= s.now
                            and r.timing.admitted > s.now]
            assert not left_waiting, "a free slot stayed idle while a request of that bucket waited"


def test_continuous_admits_at_any_step_and_retires_at_once():
    core = EngineCore(FakeExecutor(), ContinuousBatchingPolicy(4))
    long = core.add_request(SamplingParams(prompt="a", seed=1, num_inference_steps=10), 0.0)
    core.step(0.0)
    core.step(1.0)
    short = core.add_request(SamplingParams(prompt="b", seed=2, num_inference_steps=2), 2.0)
    rep = core.step(2.0)
    assert rep.admitted == [short] and rep.batch_size == 2 and long.step == 3 and short.step == 1
    rep = core.step(3.0)
    assert rep.finished == [short] and short.status is RequestStatus.COMPLETED
    rep = core.step(4.0)
    assert rep.batch_size == 1 and long.step == 5


def test_continuous_buckets_take_turns():
    core = EngineCore(FakeExecutor(), ContinuousBatchingPolicy(8))
    a = [core.add_request(SamplingParams(prompt="a", seed=i, num_inference_steps=5, height=32, width=32), 0.0)
         for i in range(3)]
    b = core.add_request(SamplingParams(prompt="b", seed=9, num_inference_steps=5, height=16, width=16), 0.0)
    buckets = [core.step(float(t)).progressed[0].bucket for t in range(6)]
    assert buckets[:4] == [(32, 32), (16, 16), (32, 32), (16, 16)]
    assert a[0].step == 3 and b.step == 3


@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_at_most_max_batch_size_requests_hold_latents_whatever_the_mix_of_sizes(strategy):
    """Seven sizes, 28 requests at once, max_batch_size 4: at most 4 are running (latents in memory) at any step,
    the paused ones of the buckets not run in that step included; every request still completes."""
    sizes = range(16, 65, 8)
    trace = [Arrival(0.0, SamplingParams(prompt=f"p{i}", seed=i, num_inference_steps=3 + i % 3, height=h, width=h))
             for i in range(4) for h in sizes]
    latency = LatencyModel.from_cost_model(CostModel(), [(h, h) for h in sizes])  # slo's buckets take turns
    core = EngineCore(FakeExecutor(), make_policy(strategy, max_batch_size=4, latency_model=latency))
    resident, buckets_run = [], set()

    def observe(report):
        resident.append(len(core.running))
        buckets_run.update(r.bucket for r in report.progressed[:1])

    res = simulate(core, trace, on_step=observe)
    assert all(r.status is RequestStatus.COMPLETED for r in res.requests)
    assert max(resident) == 4
    assert len(buckets_run) == len(sizes)


def test_make_policy_names_allowed_values():
    with pytest.raises(ValueError, match="allowed: continuous, dynamic, static, none"):
        make_policy("greedy")
    with pytest.raises(ValueError, match="max_batch_size"):
        make_policy("continuous", max_batch_size=0)


@pytest.mark.parametrize("policy", [StaticBatchingPolicy(2, flush_timeout_s=1.0), DynamicBatchingPolicy(2, 1.0)])
def test_request_level_policies_start_the_oldest_bucket_whose_batch_is_ready(policy):
    def add(core, t, size, i):
        return core.add_request(SamplingParams(prompt="p", seed=i, num_inference_steps=2, height=size, width=size), t)

    # Both ready: the bucket with the older waiting request goes first.
    core = EngineCore(FakeExecutor(), policy)
    old = [add(core, 0.0, 32, 0), add(core, 0.05, 32, 1)]
    add(core, 0.1, 16, 2)
    add(core, 0.1, 16, 3)
    assert core.step(0.2).admitted == old

    # The older bucket is still filling: the younger full one goes first; the older one when its wait is up.
    core = EngineCore(FakeExecutor(), policy)
    lone = add(core, 0.0, 32, 0)
    young = [add(core, 0.1, 16, 1), add(core, 0.1, 16, 2)]
    rep = core.step(0.2)
    assert rep.admitted == young
    while core.running:
        rep = core.step(0.3)
    rep = core.step(0.4)
    assert rep.batch_size == 0 and lone.status is RequestStatus.WAITING and rep.wake_at == 1.0
    assert core.step(1.0).admitted == [lone]
