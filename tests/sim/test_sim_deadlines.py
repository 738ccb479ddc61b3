"""Deadlines on the simulated clock: a request's deadline counts from its arrival (not from the end of the step it
arrived during), so no answer comes back OK after its deadline, decode included; and a refusal at admission is
told at the arrival time, as the live front end tells it.

The latency model makes decoding as costly as a denoising step, where arriving mid-step used to shift a request's
deadline by up to a step and a decode."""

from __future__ import annotations

import asyncio

import pytest

from stepserve.bench.metrics import late_answers, refusal_timing
from stepserve.bench.runner import LoadPlan
from stepserve.bench.targets import OK, REJECTED, TIMEOUT, Contender
from stepserve.bench.workload import Mix, RequestSpec, Trace, TraceItem, poisson_trace
from stepserve.costs import CostModel, LatencyModel
from stepserve.engine.core import EngineCore
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker, make_core
from stepserve.sim.drive import drive_open

# a step of 40-70 ms, a decode of 50-120 ms: decoding costs about a step
COST = CostModel(step_fixed_s=0.040, step_per_item_s=0.004, decode_fixed_s=0.040, decode_per_item_s=0.010)
LATENCY = LatencyModel.from_cost_model(COST)
MIX = Mix.from_steps([4, 8, 16])


def _run(strategy: str, rate: float, timeout_s: float, duration_s: float = 30.0):
    trace = poisson_trace(MIX, rate, duration_s, seed=1).with_timeout(timeout_s)
    plan = LoadPlan("open", MIX, 1, 0.0, duration_s, 10.0, trace=trace, timeout_s=timeout_s)
    driver = SimulatedDriver(SimSetup(LATENCY))
    ran = asyncio.run(driver.run(contender_maker(Contender(strategy, max_batch_size=8)), plan, 0, lambda _: None))
    return ran.result.outcomes


@pytest.mark.parametrize("strategy,rate", [("slo", 8.0), ("slo", 30.0), ("continuous", 15.0)])
def test_no_answer_comes_back_ok_after_its_deadline(strategy, rate):
    outcomes = _run(strategy, rate, timeout_s=1.5)
    statuses = {o.status for o in outcomes}
    assert OK in statuses and TIMEOUT in statuses  # loaded enough that deadlines bite
    late = late_answers(outcomes)
    assert late.count == 0, late
    for o in outcomes:
        if o.status == OK:
            assert o.done_s - o.sent_s <= o.spec.timeout_s


@pytest.mark.parametrize("rate", [8.0, 30.0])
def test_refusals_at_admission_are_told_at_the_arrival_time(rate):
    outcomes = _run("slo", rate, timeout_s=1.5)
    refused = [o for o in outcomes if o.status == REJECTED]
    assert len(refused) > 10
    assert all(o.done_s == o.sent_s == o.scheduled_s for o in refused)
    timing = refusal_timing(outcomes)
    assert timing.count == len(refused) and timing.max_ms == 0.0


def _core(strategy: str) -> EngineCore:
    return make_core(SimSetup(LATENCY), Contender(strategy, max_batch_size=8), seed=0)


def test_a_request_arriving_during_a_step_keeps_its_own_arrival_time_and_deadline():
    # the first request starts a step at 0 (encode + a step of 40+ ms); the second arrives 10 ms into it
    spec = RequestSpec(prompt="a seven", seed=0, num_inference_steps=4, timeout_s=5.0)
    trace = Trace([TraceItem(0.0, spec), TraceItem(0.010, spec)])
    core = _core("continuous")
    seen = []
    add = core.new_request

    def spy(params, now, *args, **kwargs):
        request = add(params, now, *args, **kwargs)
        seen.append(request)
        return request

    core.new_request = spy
    driven = drive_open(core, trace, 0.0, 60.0)
    assert [o.status for o in driven.outcomes] == [OK, OK]
    assert [r.arrival_time for r in seen] == [0.0, 0.010]
    assert seen[1].deadline == pytest.approx(0.010 + 5.0 - core.answer_margin_s)


def test_an_infeasible_request_arriving_mid_step_is_refused_at_its_arrival():
    # 40 steps cannot be done in 0.5 s even alone: refused at once, while the engine is busy with the first one
    busy = RequestSpec(prompt="a seven", seed=0, num_inference_steps=8, timeout_s=5.0)
    hopeless = RequestSpec(prompt="a three", seed=1, num_inference_steps=40, timeout_s=0.5)
    driven = drive_open(_core("slo"), Trace([TraceItem(0.0, busy), TraceItem(0.023, hopeless)]), 0.0, 60.0)
    first, second = driven.outcomes
    assert first.status == OK
    assert second.status == REJECTED and second.done_s == 0.023


def test_a_refusal_on_an_idle_engine_is_told_at_its_arrival_and_the_run_ends():
    from stepserve.sim import Arrival, simulate
    from stepserve.request.types import RequestStatus, SamplingParams

    hopeless = SamplingParams(prompt="a seven", seed=0, num_inference_steps=40, timeout_s=0.01)
    core = _core("slo")
    result = simulate(core, [Arrival(0.5, hopeless)])
    assert [(r.status, r.timing.finished) for r in result.requests] == [(RequestStatus.REJECTED, 0.5)]
    assert not core.has_work()
