"""The device policy of several models on one device (scheduling.device_share): its rules one by one, the
simulator's replicas of several models that run it (sim.device), and the fairness acceptance on a seeded trace
(sim.fairness): the deadline model within 5 points of its attainment alone at its share, the other model at
least 0.9 of its share's throughput, no step waiting longer than the aging bound plus one step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stepserve.costs import FakeExecutor, LatencyModel
from stepserve.costs.latency_model import Curve
from stepserve.engine.config import EngineOptions
from stepserve.request.types import RequestStatus, SamplingParams
from stepserve.scheduling.device_share import DeviceShare, EngineBid, share_of
from stepserve.sim import Arrival, simulate
from stepserve.sim.device import Models, UnknownModel
from stepserve.sim.fairness import BATCH, DEADLINE, FairnessCase, measure, slowed
from stepserve.sim.replicas import run_replicas
from stepserve.fleet.routers import make_router


# --- the policy's rules ----------------------------------------------------------------------------------------
def test_a_lone_bid_is_picked():
    bid = EngineBid("a", 0.0)
    assert DeviceShare().pick([bid], 0.0) is bid


def test_no_bids_is_an_error_that_says_so():
    with pytest.raises(ValueError, match="at least one bid"):
        DeviceShare().pick([], 0.0)


def test_a_bid_waiting_past_the_aging_bound_goes_first_even_against_an_earlier_deadline():
    share = DeviceShare(aging_s=2.0)
    old, urgent = EngineBid("old", 0.0), EngineBid("urgent", 2.9, deadline=3.0)
    assert share.pick([urgent, old], 2.5).model == "old"
    assert share.pick([urgent, EngineBid("old", 1.0)], 2.5).model == "urgent"  # waited 1.5 s: not aged yet


def test_earliest_deadline_by_slack_among_models_within_their_share():
    share = DeviceShare()
    late, soon = EngineBid("a", 0.0, deadline=10.0), EngineBid("b", 0.0, deadline=5.0)
    assert share.pick([late, soon], 0.0).model == "b"
    # slack, not the deadline: b's step is predicted to take 6 s, so a (deadline 10, step 1 s) is the tighter one
    assert share.pick([EngineBid("a", 0.0, 10.0, 1.0), EngineBid("b", 0.0, 5.0, 6.0)], 0.0).model == "b"
    assert share.pick([EngineBid("a", 0.0, 10.0, 8.0), EngineBid("b", 0.0, 11.0, 0.5)], 0.0).model == "a"


def test_a_bid_without_a_deadline_ranks_after_one_with_a_deadline():
    share = DeviceShare()
    assert share.pick([EngineBid("free", 0.0), EngineBid("due", 0.0, deadline=1e9)], 0.0).model == "due"


def test_a_model_past_its_share_by_more_than_the_borrow_runs_only_when_no_model_within_bids():
    share = DeviceShare(borrow_s=1.0)
    share.pick([EngineBid("a", 0.0), EngineBid("b", 0.0)], 0.0)
    share.charge("a", 1.5)  # a is 1.5 device seconds ahead of b: past the 1 s it may borrow
    assert share.pick([EngineBid("a", 0.0, deadline=1.0), EngineBid("b", 0.0)], 0.1).model == "b"
    assert share.pick([EngineBid("a", 0.0, deadline=1.0)], 0.1).model == "a"  # work-conserving: alone, it runs
    share.charge("b", 1.0)  # now 0.5 s ahead: within the borrow, its earlier deadline wins again
    assert share.pick([EngineBid("a", 0.0, deadline=1.0), EngineBid("b", 0.0)], 0.2).model == "a"


def test_weights_scale_the_device_time_a_model_may_use():
    share = DeviceShare(weights={"big": 3.0}, borrow_s=0.5)
    share.pick([EngineBid("big", 0.0), EngineBid("small", 0.0)], 0.0)
    share.charge("big", 3.0)  # 1 s of weighted time, as much as small's 1 s below
    share.charge("small", 1.0)
    assert share.used["big"] == pytest.approx(share.used["small"])
    assert share_of({"big": 3.0}, ["big", "small"]) == {"big": 0.75, "small": 0.25}


def test_then_the_least_used_share_then_the_longest_waiting():
    share = DeviceShare(borrow_s=10.0)
    share.pick([EngineBid("a", 0.0), EngineBid("b", 0.0)], 0.0)
    share.charge("a", 2.0)
    assert share.pick([EngineBid("a", 0.0), EngineBid("b", 0.5)], 0.6).model == "b"  # less used
    share.charge("b", 2.0)
    assert share.pick([EngineBid("a", 0.4), EngineBid("b", 0.5)], 0.6).model == "a"  # same use: waited longer


def test_a_model_back_from_an_idle_spell_starts_at_the_least_used_share_and_banks_nothing():
    """Nothing but a credit of borrow_s (as a scheduler's sleeper credit: a short request then runs whole)."""
    share = DeviceShare(aging_s=2.0, borrow_s=0.5)
    share.pick([EngineBid("a", 0.0), EngineBid("b", 0.0)], 0.0)
    for t in range(1, 11):  # a alone for 10 s; b bids nothing
        share.pick([EngineBid("a", float(t))], float(t))
        share.charge("a", 1.0)
    share.pick([EngineBid("a", 11.0), EngineBid("b", 11.0)], 11.0)
    assert share.used["b"] == pytest.approx(share.used["a"] - 0.5)  # not 10 s behind: it cannot shut a out 10 s


def test_bad_settings_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="aging_s must be a positive number"):
        DeviceShare(aging_s=0)
    with pytest.raises(ValueError, match="borrow_s must be a number of seconds >= 0"):
        DeviceShare(borrow_s=-1)
    with pytest.raises(ValueError, match="the weight of model 'x' must be a positive number"):
        DeviceShare(weights={"x": 0})


# --- the simulator's replicas of several models ----------------------------------------------------------------
def flat(step_s: float) -> LatencyModel:
    """Every step step_s at any batch; encode and decode free."""
    zero = Curve(((1, 0.0),))
    return LatencyModel(step={(32, 32): Curve(((1, step_s), (8, step_s)))}, encode=zero, decode={(32, 32): zero})


def engine(step_s: float, strategy: str = "continuous"):
    return EngineOptions(strategy=strategy, max_batch_size=4).make_core(FakeExecutor.charging(flat(step_s)))


def ask(t: float, model: str | None, steps: int = 4, timeout_s: float | None = None) -> Arrival:
    return Arrival(t, SamplingParams(prompt="a", seed=1, num_inference_steps=steps, timeout_s=timeout_s), model=model)


def test_each_request_runs_in_the_engine_of_the_model_it_names_and_the_device_runs_one_step_at_a_time():
    models = Models({"fast": engine(0.1), "slow": engine(1.0)})
    steps = []
    done = simulate(models, [ask(0.0, "fast"), ask(0.0, "slow"), ask(0.0, None)],
                    on_step=lambda rep: steps.append((rep.now, rep.duration_s, models.last))).requests
    assert [r.status for r in done] == [RequestStatus.COMPLETED] * 3
    assert models.use["fast"].steps == 4 and models.use["slow"].steps == 4  # "fast" is the default: 2 rows, 4 steps
    assert models.use["fast"].busy_s == pytest.approx(0.4) and models.use["slow"].busy_s == pytest.approx(4.0)
    for (t0, d0, _), (t1, _, _) in zip(steps, steps[1:]):
        assert t1 >= t0 + d0 - 1e-9  # no two steps overlap: one device
    assert {m for *_, m in steps} == {"fast", "slow"}


def test_a_request_for_a_model_the_replica_does_not_hold_is_an_input_error_naming_the_held_ones():
    models = Models({"a": engine(0.1), "b": engine(0.1)})
    with pytest.raises(UnknownModel, match="names model 'c', which this replica does not hold; it holds: a, b"):
        simulate(models, [ask(0.0, "c")])


def test_the_deadline_model_is_stepped_first_while_within_its_share():
    models = Models({"batch": engine(1.0), "due": engine(1.0)})
    done = simulate(models, [ask(0.0, "batch", steps=10), ask(0.5, "due", steps=2, timeout_s=3.5)]).requests
    assert done[1].status is RequestStatus.COMPLETED  # it waited for the step in flight, then ran its 2 steps
    assert done[1].timing.finished == pytest.approx(3.0)


def test_a_model_the_device_share_holds_back_still_steps_within_the_aging_bound():
    share = DeviceShare(aging_s=2.0, borrow_s=100.0)  # shares never bind: only deadlines and aging decide
    models = Models({"free": engine(0.5), "due": engine(0.5)}, share)
    due = [ask(0.25 * i, "due", steps=1, timeout_s=1e6) for i in range(40)]  # always a deadline bid waiting
    simulate(models, [ask(0.0, "free", steps=3)] + due)
    assert models.use["free"].steps == 3
    assert models.use["free"].max_wait_s <= 2.0 + 0.5 + 1e-9  # the aging bound plus the step in flight


def test_a_fleet_of_replicas_that_hold_several_models_serves_every_request_on_its_model():
    replicas = [Models({"a": engine(0.1), "b": engine(0.3)}) for _ in range(3)]
    arrivals = [ask(0.05 * i, "ab"[i % 2], steps=5) for i in range(60)]
    result = run_replicas(replicas, arrivals, make_router("least_work"))
    assert all(o.status == "completed" for o in result.outcomes)
    assert sum(m.use["a"].steps > 0 for m in replicas) >= 2  # spread over the replicas
    for model in "ab":  # every row-step of a model's 30 requests ran in that model's engines
        assert sum(sum(m.cores[model].executor.forward_batch_sizes) for m in replicas) == 30 * 5


# --- the acceptance: fairness on a seeded trace ----------------------------------------------------------------
SD15 = "stepserve/models/latency/gpu-sd15-512.json"


@pytest.mark.parametrize("load", [1.2, 1.5])
@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_fairness_a_deadline_model_within_its_share_and_a_backlogged_one(load, strategy):
    """Drafts (8 steps, deadline 2 s) and finals (20 steps, no deadline) of one SD 1.5-class curve, half the
    requests each, offered 1.2 and 1.5 times what the device serves: the drafts' work is about its share."""
    sd15 = LatencyModel.load(SD15)
    f = measure(FairnessCase(sd15, sd15, load=load, timeout_s=2.0, deadline_steps=8, batch_steps=20,
                             duration_s=120.0, strategy=strategy))
    assert f.attainment_shared >= f.attainment_alone - 0.05, f
    assert f.batch_ratio >= 0.9, f
    assert f.max_wait_s <= f.wait_bound_s, f
    assert sum(f.device_frac.values()) == pytest.approx(1.0, abs=0.02)  # saturated: the device never idled


def test_fairness_with_weights_the_deadline_model_at_a_quarter_of_the_device():
    sd15 = LatencyModel.load(SD15)
    f = measure(FairnessCase(sd15, sd15, load=1.3, timeout_s=3.0, deadline_steps=8, batch_steps=20,
                             weights={DEADLINE: 1.0, BATCH: 3.0}, duration_s=120.0))
    assert f.shares == {DEADLINE: 0.25, BATCH: 0.75}
    assert f.attainment_shared >= f.attainment_alone - 0.05, f
    assert f.batch_ratio >= 0.9 and f.max_wait_s <= f.wait_bound_s, f
    assert f.device_frac[BATCH] >= 0.75 * 0.9


def test_alone_at_a_share_means_every_stage_takes_one_over_the_share_as_long():
    sd15 = LatencyModel.load(SD15)
    half = slowed(sd15, 2.0)
    assert half.step_s(4) == pytest.approx(2 * sd15.step_s(4))
    assert half.encode_s(3) == pytest.approx(2 * sd15.encode_s(3))
    assert half.decode_s(2) == pytest.approx(2 * sd15.decode_s(2))


def test_a_router_prices_a_shared_replica_as_the_requests_model_sees_it():
    from stepserve.sim.fleet import Fleet
    from stepserve.sim.loop import SimLoop

    busy, idle = Models({"a": engine(0.1), "b": engine(1.0)}), Models({"a": engine(0.1), "b": engine(1.0)})
    loop = SimLoop([busy, idle], Fleet(make_router("least_work")))
    busy.cores["b"].add_request(SamplingParams(prompt="x", seed=1, num_inference_steps=10), 0.0)
    for_a, other = loop.fleet.fresh(0, 0.0, "a"), loop.fleet.fresh(1, 0.0, "a")
    assert for_a.outstanding == 0 and for_a.work_s == pytest.approx(10.0)  # b's 10 steps of 1 s on the device
    assert for_a.fixed_s == pytest.approx(other.fixed_s + 10.0)  # an "a" request shares the device with them
    assert loop.fleet.fresh(0, 0.0, "b").outstanding == 1


def test_a_central_queue_in_front_of_shared_replicas_keeps_each_requests_model():
    from stepserve.sim.fleet import Fleet

    replicas = [Models({"a": engine(0.1), "b": engine(0.2)}) for _ in range(2)]
    arrivals = [ask(0.01 * i, "ab"[i % 3 == 0], steps=3) for i in range(30)]
    result = run_replicas(replicas, arrivals, Fleet(None, central_hold=1))
    assert all(o.status == "completed" for o in result.outcomes)
    for model, sent in (("a", 20), ("b", 10)):
        assert sum(sum(m.cores[model].executor.forward_batch_sizes) for m in replicas) == 3 * sent


def test_the_slo_policy_planning_at_the_whole_device_misses_and_planning_at_its_share_does_not():
    """The finding docs/BENCHMARKS.md reports: on a shared device an slo policy that plans at the whole device's
    speed admits what its share cannot finish; planning at the share it gets now (the default, as live) brings it
    within 5 points of itself alone at its share, the other model keeping its share."""
    sd15 = LatencyModel.load(SD15)
    over = FairnessCase(sd15, sd15, load=1.5, timeout_s=4.0, deadline_steps=20, batch_steps=20, duration_s=120.0,
                        strategy="slo")
    plain, at_share = measure(replace(over, plan_shares=False)), measure(over)
    assert plain.attainment_gap > 0.2 and plain.batch_ratio >= 0.9  # the device's split holds; the policy misses
    assert at_share.passes, at_share
    assert at_share.attainment_alone == plain.attainment_alone  # the yardstick is the same run


@pytest.mark.parametrize("strategy", ["continuous", "dynamic", "slo"])
def test_a_replica_of_one_model_steps_exactly_as_a_lone_engine(strategy):
    arrivals = [ask(0.07 * i, None, steps=2 + i % 5, timeout_s=2.0 if i % 3 else None) for i in range(80)]
    lone = simulate(engine(0.05, strategy), arrivals).requests
    held = simulate(Models({"only": engine(0.05, strategy)}), arrivals).requests
    assert [(r.status, r.timing.finished) for r in held] == [(r.status, r.timing.finished) for r in lone]
