"""Deadlines in messages are printed at a precision people can use: a 10 ms timeout_s is "10 ms", never
"0.000 s", and a deadline the answer margin ate says so."""

from __future__ import annotations

from stepserve.costs import CostModel, FakeExecutor, LatencyModel
from stepserve.engine.core import EngineCore
from stepserve.request.types import SamplingParams
from stepserve.scheduling import SLOPolicy
from stepserve.scheduling.predict import earliest_finish
from stepserve.util.words import duration

MODEL = LatencyModel.from_cost_model(CostModel(), buckets=[(32, 32)])


def core(answer_margin_s: float) -> EngineCore:
    return EngineCore(FakeExecutor(cost=CostModel()), SLOPolicy(4, MODEL), answer_margin_s=answer_margin_s)


def request(engine: EngineCore, timeout_s: float):
    return engine.new_request(SamplingParams(prompt="p", seed=1, num_inference_steps=20, guidance_scale=3.0,
                                             height=32, width=32, timeout_s=timeout_s), 100.0)


def test_durations_read_in_milliseconds_below_a_second():
    assert [duration(s) for s in (0.01, 0.0004, 0.0123, 0.19, 0.999, 0.0, 1.26, 12.34, 125.4, -0.005)] == [
        "10 ms", "0.4 ms", "12.3 ms", "190 ms", "999 ms", "0 ms", "1.26 s", "12.3 s", "125 s", "-5 ms"]


def test_an_infeasible_deadline_of_10_ms_is_printed_as_10_ms():
    engine = core(answer_margin_s=0.0)
    r = request(engine, 0.01)
    message = engine.policy.infeasible(r, 100.0)
    assert message is not None and "its deadline is in 10 ms" in message and "0.000" not in message, message
    needed = message.split("needs at least ", 1)[1].split(" even alone", 1)[0]
    assert needed == duration(earliest_finish(r, MODEL, 100.0) - 100.0), message


def test_a_deadline_eaten_by_the_answer_margin_says_so():
    engine = core(answer_margin_s=0.01)
    message = engine.policy.infeasible(request(engine, 0.01), 100.0)
    assert "its deadline is in 0 ms (timeout_s 10 ms, less 10 ms kept to send the answer)" in message, message
