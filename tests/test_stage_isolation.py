"""One request's failure stays its own: when a stage (prepare, denoise, decode) raises for a batch, the engine
retries the batch in halves (bisection) until the culprit runs alone, so only the culprit fails."""

import pytest

from stepserve.costs import FakeExecutor
from stepserve.engine.core import EngineCore
from stepserve.scheduling import STRATEGIES, make_policy
from stepserve.sim import Arrival, simulate
from stepserve.request.types import FinishReason, RequestStatus, SamplingParams

POISON = "poisoned"


def _run(strategy: str, stage: str | None, with_poison: bool):
    calls: list[tuple[str, int]] = []

    def fault(s, requests) -> bool:
        calls.append((s, len(requests)))
        return s == stage and any(r.params.prompt == POISON for r in requests)

    core = EngineCore(FakeExecutor(fault=fault), make_policy(strategy, max_batch_size=4, max_queue_delay_ms=1.0,
                                                             static_batch_size=4))
    trace = [Arrival(0.0, SamplingParams(prompt=f"healthy {i}", seed=i, num_inference_steps=3 + i % 2))
             for i in range(6)]
    if with_poison:  # arrives among the healthy ones, so it is admitted into a batch with them
        trace.insert(2, Arrival(0.0, SamplingParams(prompt=POISON, seed=99, num_inference_steps=3)))
    return simulate(core, trace).requests, calls


@pytest.mark.parametrize("stage", ["prepare", "denoise", "decode"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_poisoned_request_fails_alone_and_its_batch_mates_get_their_images(strategy, stage):
    clean, _ = _run(strategy, stage, with_poison=False)
    mixed, calls = _run(strategy, stage, with_poison=True)
    poisoned = [r for r in mixed if r.params.prompt == POISON]
    healthy = [r for r in mixed if r.params.prompt != POISON]
    assert len(poisoned) == 1 and poisoned[0].status is RequestStatus.FAILED
    assert poisoned[0].finish_reason is FinishReason.ERROR and f"injected {stage} fault" in poisoned[0].error
    assert (stage, 1) in calls  # the culprit was run alone before it was failed
    assert all(r.status is RequestStatus.COMPLETED for r in healthy), [(r.params.prompt, r.error) for r in healthy]
    # the same images as a run without the poisoned request, each step taken once
    assert [(r.params.seed, r.image, r.sampler_state) for r in healthy] == \
        [(r.params.seed, r.image, r.sampler_state) for r in clean]
    for r in healthy:
        assert len(r.timing.batch_sizes) == r.num_inference_steps


def test_a_broken_model_still_fails_every_request_and_the_engine_serves_on():
    core = EngineCore(FakeExecutor(fault=lambda stage, requests: stage == "denoise"), make_policy("continuous", 4))
    result = simulate(core, [Arrival(0.0, SamplingParams(prompt=f"p{i}", seed=i, num_inference_steps=2))
                             for i in range(5)])
    assert all(r.status is RequestStatus.FAILED and "injected denoise fault" in r.error for r in result.requests)
    assert not core.has_work()
