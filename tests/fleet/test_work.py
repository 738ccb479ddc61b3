"""The work in hand: the engine core's Tally always equals a recount of the requests it holds (whatever arrives,
runs, is refused, aborted, given up or times out), and work_s prices it with the latency model as documented."""

import random

import pytest

from stepserve.costs.fake import FakeExecutor
from stepserve.costs.latency_model import Curve, LatencyModel
from stepserve.engine.admission_errors import AdmissionError
from stepserve.engine.config import EngineOptions
from stepserve.fleet.stats import replica_stats, runs_at_once
from stepserve.fleet.work import Tally, bucket_s, work_s
from stepserve.request.types import SamplingParams

A, B = (32, 32), (48, 48)
MODEL = LatencyModel(step={A: Curve(((1, 0.02), (4, 0.035), (8, 0.05)))}, encode=Curve(((1, 0.002), (8, 0.004))),
                     decode={A: Curve(((1, 0.003), (8, 0.008)))}, reference_bucket=A)


def held(core):
    return list(core.waiting) + list(core.running) + list(core.to_decode)


@pytest.mark.parametrize("strategy, seed", [("slo", 1), ("slo", 2), ("continuous", 3), ("dynamic", 4),
                                            ("static", 5)])
def test_the_tally_is_a_recount_of_the_requests_held_after_every_step(strategy, seed):
    rng = random.Random(seed)
    core = EngineOptions(strategy, max_batch_size=4, max_queue=12, latency_model=MODEL).make_core(
        FakeExecutor.charging(MODEL))
    now, ids = 0.0, []
    for _ in range(400):
        for _ in range(rng.choice((0, 0, 1, 3))):
            size = rng.choice((32, 48))
            params = SamplingParams(prompt="p", seed=rng.randrange(99), num_inference_steps=rng.choice((2, 5, 9)),
                                    height=size, width=size,
                                    timeout_s=rng.choice((None, 0.05, 0.4, 3.0)) if strategy == "slo" else None)
            try:
                ids.append(core.add_request(params, now).request_id)
            except AdmissionError:
                pass
        if ids and rng.random() < 0.1:
            core.abort(rng.choice(ids))
        report = core.step(now)
        now += report.duration_s or 0.01
        assert core.tally.snapshot() == Tally(held(core)).snapshot()
    assert core.tally.version > 0


def test_work_is_every_remaining_step_at_the_row_cost_of_the_batch_it_runs_at():
    step4, dec4, enc4 = MODEL.step_s(4, A), MODEL.decode_s(4, A), MODEL.encode_s(4)
    assert bucket_s(4, 30, 1, A, MODEL, 8) == pytest.approx((30 * step4 + 4 * dec4 + enc4) / 4)
    # more requests than the batch: the full batch's row cost
    assert bucket_s(20, 100, 20, A, MODEL, 8) == pytest.approx(
        (100 * MODEL.step_s(8, A) + 20 * MODEL.decode_s(8, A) + 20 * MODEL.encode_s(8)) / 8)
    assert bucket_s(0, 0, 0, A, MODEL, 8) == 0.0
    # buckets add up; an unmeasured bucket costs by pixels (the latency model's rule)
    loads = {A: [4, 30, 1], B: [1, 10, 0]}
    assert work_s(loads, MODEL, 8) == pytest.approx(bucket_s(4, 30, 1, A, MODEL, 8) + bucket_s(1, 10, 0, B, MODEL, 8))
    assert bucket_s(1, 10, 0, B, MODEL, 8) == pytest.approx((10 * MODEL.step_s(1, B) + MODEL.decode_s(1, B)))
    assert MODEL.step_s(1, B) == pytest.approx(MODEL.step_s(1, A) * 48 * 48 / (32 * 32))


def test_replica_stats_quote_the_steps_a_newcomer_would_run_at():
    s = replica_stats({A: [3, 30, 0]}, MODEL, 8, adapters={"ink"}, earliest_deadline=5.0, now=1.0)
    assert s.outstanding == 3 and s.adapters == frozenset({"ink"})
    assert s.work_s == pytest.approx(work_s({A: [3, 30, 0]}, MODEL, 8))
    assert s.curve == tuple(MODEL.step_s(b, A) for b in range(1, 9))  # batching pays here: up to 8 at once
    assert s.fixed_s == pytest.approx(MODEL.decode_s(1, A) + MODEL.encode_s(1))
    assert s.slack_s == pytest.approx(5.0 - 1.0 - s.work_s) and s.pixels == 32 * 32
    idle = replica_stats({}, MODEL, 8)
    assert idle.work_s == 0 and idle.slack_s == float("inf")
    again = type(s).from_dict(s.to_dict())
    assert again == s and type(s).from_dict(idle.to_dict()) == idle


def test_where_a_batch_of_n_costs_n_steps_of_one_a_cost_aware_replica_runs_one_at_a_time():
    linear = LatencyModel(step={A: Curve(((1, 0.15), (8, 1.18)))}, encode=Curve(((1, 0.02),)),
                          decode={A: Curve(((1, 0.08),))}, reference_bucket=A)
    assert runs_at_once(linear, A, 8) == 1 and runs_at_once(linear, A, 8, cost_aware=False) == 8
    assert runs_at_once(MODEL, A, 8) == 8 and runs_at_once(MODEL, A, 1) == 1
    assert replica_stats({}, linear, 8).curve == (0.15,)
