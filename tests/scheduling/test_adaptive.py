"""Cost-aware continuous batching: the cap per regime, oldest first, pauses at step boundaries, and adaptation
when the step cost changes mid-run (simulated clock, the policy unchanged)."""

from __future__ import annotations

import random

import pytest

from stepserve.costs import CostModel, FakeExecutor, LatencyModel
from stepserve.engine.config import EngineOptions
from stepserve.scheduling import AdaptiveBatchingPolicy, make_policy
from stepserve.sim import Arrival, simulate
from stepserve.request.types import Request, RequestStatus, SamplingParams

B = (32, 32)


def request(i: int, t: float = 0.0, steps: int = 10, status=RequestStatus.WAITING) -> Request:
    params = SamplingParams(prompt=f"r{i}", seed=i, num_inference_steps=steps, guidance_scale=1.0, height=32,
                            width=32)
    return Request(f"r{i}", params, t, B, steps, status=status)


def test_cheap_batching_runs_everyone_and_compute_bound_runs_the_oldest_alone():
    cheap = make_policy("adaptive", 8, latency_model=LatencyModel.from_cost_model(CostModel()))
    bound = make_policy("adaptive", 8, latency_model=LatencyModel.from_cost_model(
        CostModel(step_fixed_s=0.0005, step_per_item_s=0.035)))
    waiting = [request(i, t=i * 0.1) for i in range(6)]
    assert len(cheap.schedule(waiting, [], 1.0).run) == 6
    plan = bound.schedule(list(reversed(waiting)), [], 1.0)
    assert [r.request_id for r in plan.run] == ["r0"] and plan.admit == plan.run  # the oldest; no one else held


def test_slot_holders_beyond_the_cap_pause_and_keep_their_state():
    policy = AdaptiveBatchingPolicy(8, LatencyModel.from_cost_model(CostModel(step_fixed_s=0.0005,
                                                                              step_per_item_s=0.035)))
    running = [request(i, t=i, status=RequestStatus.RUNNING) for i in range(3)]
    plan = policy.schedule([], running, 10.0)
    assert plan.run == running[:1] and not plan.admit  # the two others pause: still running, not stepped


CHEAP = CostModel(step_fixed_s=0.010, step_per_item_s=0.0005)
BOUND = CostModel(step_fixed_s=0.0005, step_per_item_s=0.025)  # one more request costs 50x as much


class CostSwitch(FakeExecutor):
    """Charges `first` until `after` denoising calls, then `then`."""

    def __init__(self, first: CostModel, then: CostModel, after: int) -> None:
        super().__init__(cost=first)
        self.then, self.after, self.calls = then, after, 0

    def denoise(self, requests):
        self.calls += 1
        if self.calls == self.after:
            self.cost = self.then
        return super().denoise(requests)


def run_with_caps(strategy: str, executor: CostSwitch, arrivals: list[Arrival]) -> list[tuple[float, int, int]]:
    """(time, denoise calls so far, cap in force) after every step; every request must complete."""
    core = EngineOptions(strategy=strategy, max_batch_size=8).make_core(executor)
    caps = []

    def on_step(report) -> None:
        caps.append((report.now + report.duration_s, executor.calls, max(core.policy.cap.values(), default=0)))

    result = simulate(core, arrivals, on_step=on_step)
    assert all(r.status is RequestStatus.COMPLETED for r in result.requests)
    return caps


@pytest.mark.parametrize("strategy", ["adaptive", "slo"])
def test_the_cap_follows_a_step_cost_that_changes_mid_run(strategy):
    executor = CostSwitch(CHEAP, BOUND, after=300)
    arrivals = [Arrival(i * 0.05, SamplingParams(prompt=f"a{i}", seed=i, num_inference_steps=20,
                                                 guidance_scale=1.0)) for i in range(1500)]
    caps = run_with_caps(strategy, executor, arrivals)
    before = [cap for _, calls, cap in caps if 100 < calls < 300]
    assert before and min(before) >= 3  # cheap: everyone who is there (4-6 at this load) shares each step
    switched_at = next(time for time, calls, _ in caps if calls >= 300)
    settled_at = next(time for time, calls, cap in caps if calls >= 300 and cap == 1)
    assert settled_at - switched_at <= 30.0, (switched_at, settled_at)


@pytest.mark.parametrize("strategy", ["adaptive", "slo"])
def test_the_cap_rises_again_when_batching_becomes_cheap(strategy):
    """Running one at a time shows nothing of larger batches: the cap is raised by one now and then (a probe),
    which is how a curve that became cheaper is seen."""
    executor = CostSwitch(BOUND, CHEAP, after=200)
    arrivals = [Arrival(2.0 * (i // 4), SamplingParams(prompt=f"a{i}", seed=i, num_inference_steps=5,
                                                       guidance_scale=1.0)) for i in range(4 * 60)]
    caps = run_with_caps(strategy, executor, arrivals)
    assert max(cap for _, calls, cap in caps if 100 < calls < 200) <= 2  # compute-bound: alone, or a probe
    switched_at = next(time for time, calls, _ in caps if calls >= 200)
    settled_at = next(time for time, calls, cap in caps if calls >= 200 and cap >= 4)
    assert settled_at - switched_at <= 30.0, (switched_at, settled_at)


def test_least_total_latency_shares_steps_only_with_a_shorter_request_behind_a_longer_one():
    """Compute-bound steps (a batch of b costs b steps of one): a 4-step request behind one with 15 steps left
    finishes after 8 step-costs sharing instead of 19, the long one after 19 either way, so both run; behind a
    shorter or an equal one, first come first served (sharing would only delay the first). Where batching is
    cheap every cap is better with more."""
    from stepserve.scheduling.adaptive import least_total_latency

    bound = [float(b) for b in range(1, 9)]
    assert least_total_latency(bound, [15, 4]) == 2
    assert least_total_latency(bound, [4, 15]) == 1
    assert least_total_latency(bound, [10, 10]) == 1
    assert least_total_latency(bound, [20, 3, 3, 20]) == 2  # the short ones in turn beside the head: 104 against
    # 115 one at a time, 107 all three together, 116 all four
    assert least_total_latency([1.0 + 0.01 * b for b in range(1, 9)], [10, 10, 10]) == 3


def test_a_short_request_shares_the_steps_of_a_long_one_on_a_compute_bound_curve():
    """The same rule in the policies: the long request holds its slot with 15 steps left; a 4-step arrival runs
    beside it, a 20-step one waits (paused) until it is done."""
    model = LatencyModel.from_cost_model(CostModel(step_fixed_s=0.0005, step_per_item_s=0.035))
    for name in ("adaptive", "slo"):
        policy = make_policy(name, 8, latency_model=model)
        long = request(0, steps=20, status=RequestStatus.RUNNING)
        long.step = 5
        short, longer = request(1, t=0.5, steps=4), request(2, t=0.5, steps=20)
        assert {r.request_id for r in policy.schedule([short], [long], 1.0).run} == {"r0", "r1"}, name
        plan = make_policy(name, 8, latency_model=model).schedule([longer], [long], 1.0)
        assert [r.request_id for r in plan.run] == ["r0"], name


def test_slo_takes_the_cost_aware_cap_too():
    """slo's deadline cap is bounded by the same cost-aware cap: compute-bound, no deadlines, one at a time;
    cheap batching, everyone (its decisions where batching pays are unchanged)."""
    bound = make_policy("slo", 8, latency_model=LatencyModel.from_cost_model(
        CostModel(step_fixed_s=0.0005, step_per_item_s=0.035)))
    cheap = make_policy("slo", 8, latency_model=LatencyModel.from_cost_model(CostModel()))
    waiting = [request(i, t=i * 0.1) for i in range(6)]
    assert len(bound.schedule(waiting, [], 1.0).run) == 1
    assert len(cheap.schedule(waiting, [], 1.0).run) == 6


class Superlinear(CostModel):
    """A step of b requests costs b steps of one and 10% more per request beyond the first (a batch that spills
    out of a cache): batching loses throughput. Each step's time varies by 25% (lognormal), as on a shared CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)

    def step_s(self, requests):
        b = len(requests)
        return 0.025 * b * (1.0 + 0.1 * (b - 1)) * self.rng.lognormvariate(0.0, 0.25)


@pytest.mark.parametrize("strategy", ["adaptive", "slo"])
def test_a_full_batch_that_the_prior_wrongly_says_pays_is_seen_to_cost_under_saturation(strategy):
    """Saturated (more requests than slots, all the time), every step runs about the same batch, and steps of
    one size show little of the slope: the fit starts from the prior's. A profile that says batching is cheap,
    on an engine where a batch costs more than its requests one at a time, must not keep the batch for ever:
    the cap's own moves (the smallest batch near the best throughput, probes) show the slope, and the cap comes
    down to one or two within 30 s and mostly stays there."""
    prior = LatencyModel.from_cost_model(CHEAP, buckets=[B])
    core = EngineOptions(strategy=strategy, max_batch_size=8, latency_model=prior).make_core(
        FakeExecutor(cost=Superlinear()))
    arrivals = [Arrival(0.0, SamplingParams(prompt=f"a{i}", seed=i, num_inference_steps=20, guidance_scale=1.0,
                                            height=32, width=32)) for i in range(200)]
    caps = []
    result = simulate(core, arrivals, on_step=lambda report: caps.append(
        (report.now + report.duration_s, max(core.policy.cap.values(), default=0))))
    assert all(r.status is RequestStatus.COMPLETED for r in result.requests)
    assert caps[0][1] == 8  # the prior's word: batch everyone
    settled = next((t for t, cap in caps if cap <= 2), None)
    assert settled is not None and settled <= 30.0, settled
    late = [cap for t, cap in caps if t > settled + 10.0]
    # noisy steps still make the decision flip back to a batch now and then (77% of the steps here are of one
    # or two; without noise all of them)
    assert late and sum(cap <= 2 for cap in late) >= 2 / 3 * len(late)


def test_a_prior_that_says_batching_gains_a_little_is_overturned_under_saturation_and_noise():
    """As above, with a prior whose batches gain 3% (the tiny Flux's profile): under backlog any gain above 1%
    pays, so the cap starts at a full batch, and every step after is one (saturated). The steps say a batch of 8
    costs 70% more per request than one at a time, with a 25% spread. The fit, which takes one noise for all
    sizes, leaves batching's gain between 1x and 5-6x at 3 standard errors however many full batches it sees (the
    cap stayed at 8 in 494 of 507 steps); steps of one while that is unsettled, judged against the full batches
    by each size's own noise, bring the cap down (to one or two within 40 steps here, and for good)."""
    prior = LatencyModel.from_cost_model(CostModel(step_fixed_s=0.0008, step_per_item_s=0.025), buckets=[B])
    core = EngineOptions(strategy="slo", max_batch_size=8, latency_model=prior).make_core(
        FakeExecutor(cost=Superlinear()))
    arrivals = [Arrival(0.0, SamplingParams(prompt=f"a{i}", seed=i, num_inference_steps=20, guidance_scale=1.0,
                                            height=32, width=32)) for i in range(200)]
    caps = []
    simulate(core, arrivals, on_step=lambda report: caps.append(max(core.policy.cap.values(), default=0)))
    assert sum(cap <= 2 for cap in caps[100:]) >= 2 / 3 * len(caps[100:])
