"""The online step curve: its fit, the batch it recommends in each cost regime, and how fast it follows drift."""

from __future__ import annotations

import random

import pytest

from stepserve.costs import CostModel, LatencyModel
from stepserve.costs.online import OnlineStepCurve

B = (32, 32)


def prior(fixed_s: float, per_request_s: float) -> LatencyModel:
    return LatencyModel.from_cost_model(CostModel(step_fixed_s=fixed_s, step_per_item_s=per_request_s / 2))


def test_the_fit_recovers_an_affine_curve_from_observations():
    curve = OnlineStepCurve(None, 8)
    for i in range(60):
        b = 1 + i % 8
        curve.observe(B, b, 0.010 + 0.002 * b)
    a, c = curve.line(B)
    assert abs(a - 0.010) < 1e-9 and abs(c - 0.002) < 1e-9


def test_the_batch_follows_the_cost_regime():
    cheap = OnlineStepCurve(prior(0.010, 0.001), 8)  # a step of 8 costs 1.6x a step of 1
    bound = OnlineStepCurve(prior(0.0005, 0.070), 8)  # a step of 8 costs 7.9x a step of 1
    assert cheap.efficient_batch(B, 8, tolerance=0.01, min_gain=0.10) == 8
    assert bound.efficient_batch(B, 8, tolerance=0.01, min_gain=0.10) == 1
    assert cheap.efficient_batch(B, 3, tolerance=0.01, min_gain=0.10) == 3  # never more than are there


def test_an_unknown_curve_batches_everything_so_that_it_can_be_learnt():
    curve = OnlineStepCurve(None, 8)
    assert curve.efficient_batch(B, 5, 0.01, 0.10) == 5
    for _ in range(10):
        curve.observe(B, 1, 0.05)  # every step of one size: still no slope to see
    assert curve.line(B) is None and curve.efficient_batch(B, 5, 0.01, 0.10) == 5


def test_drift_is_followed_within_a_few_half_lives():
    """The per-request cost grows 50x (say, another process took the GPU's compute): within about three
    half-lives of observed steps the recommended batch drops from 8 to 1."""
    curve = OnlineStepCurve(prior(0.010, 0.001), 8, half_life_steps=10)
    assert curve.efficient_batch(B, 8, 0.01, 0.10) == 8
    steps = 0
    while curve.efficient_batch(B, 8, 0.01, 0.10) > 1:
        b = 5 + steps % 4  # the batch sizes a loaded engine runs
        curve.observe(B, b, 0.0005 + 0.050 * b)
        steps += 1
        assert steps < 40, curve.line(B)


def noisy_caps(curve: OnlineStepCurve, fixed_s: float, per_request_s: float, spread: float, steps: int = 3000,
               available: int = 8, queued: int = 0) -> list[int]:
    """The cap of every step of a busy engine whose step times vary lognormally by `spread` around the curve."""
    from stepserve.scheduling.adaptive import cost_aware_cap

    rng = random.Random(0)
    caps = []
    for step in range(1, steps + 1):
        cap = cost_aware_cap(curve, B, [20] * available, step, queued=queued)  # equal work: no present-work gain
        caps.append(cap)
        curve.observe(B, cap, (fixed_s + per_request_s * cap) * rng.lognormvariate(0, spread))
    return caps


def test_noisy_steps_do_not_flip_the_decision():
    """A compute-bound curve (a batch of 8 gains 6%) observed with a 30% spread per step: one at a time, with a
    probe of two every 50 steps, and never a larger batch (a slope read from the few probe steps among the noisy
    ones used to send the cap to a full batch in about a quarter of the steps). A cheap curve under the same noise
    keeps batching everyone, after a few steps of one that settle, from the steps at both sizes themselves, that
    batching pays."""
    bound = noisy_caps(OnlineStepCurve(prior(0.004, 0.053), 8), 0.004, 0.053, spread=0.3)
    assert max(bound) == 2 and bound.count(2) == len(bound) // 50
    cheap = noisy_caps(OnlineStepCurve(prior(0.010, 0.001), 8), 0.010, 0.001, spread=0.3)
    assert cheap.count(1) <= 5 and min(c for c in cheap if c > 1) >= 6 and cheap.count(8) >= 0.95 * len(cheap)


def test_a_queue_waiting_for_slots_makes_a_small_gain_pay():
    """The same compute-bound curve: with requests waiting for a slot, its 6% gain is worth taking (throughput
    sets their wait); with none waiting, one at a time."""
    alone = noisy_caps(OnlineStepCurve(prior(0.004, 0.053), 8), 0.004, 0.053, spread=0.0, steps=200)
    queue = noisy_caps(OnlineStepCurve(prior(0.004, 0.053), 8), 0.004, 0.053, spread=0.0, steps=200, queued=5)
    assert max(alone) == 2 and min(queue) >= 4  # 4: within 1% of the best throughput (the tolerance)


def test_step_costs_keep_the_priors_shape_on_the_observed_line():
    """A prior whose batch of 3 runs better than its line (the tiny Flux on this CPU does): with no steps seen, the
    costs are the prior's own points; once steps at twice the prior's times are seen at every size, twice them."""
    from stepserve.costs.latency_model import Curve

    points = ((1, 0.057), (2, 0.111), (3, 0.155), (4, 0.222), (5, 0.270), (6, 0.321), (7, 0.384), (8, 0.448))
    model = LatencyModel(step={B: Curve(points)}, encode=Curve(((1, 0.0),)), decode={B: Curve(((1, 0.0),))})
    curve = OnlineStepCurve(model, 8)
    assert curve.step_costs(B, 8) == pytest.approx([t for _, t in points], rel=1e-9)
    for i in range(400):
        b = 1 + i % 8
        curve.observe(B, b, 2 * points[b - 1][1])
    assert curve.step_costs(B, 8) == pytest.approx([2 * t for _, t in points], rel=0.01)
    assert OnlineStepCurve(None, 8).step_costs(B, 8) is None  # nothing known yet


def test_a_small_gain_within_the_profiles_own_noise_does_not_start_a_saturated_engine_batching():
    """A start-up profile of the tiny Flux on a slower CPU (a batch of b costs 0.92-1.00x b steps of one, not on a
    line): its line says a batch of 8 gains 10%, and its own departures from a line allow 1.0x to 1.5x. An engine
    that starts saturated (requests waiting for slots: any gain above 1% pays) runs one at a time until the
    steps show that batching pays; it used to take the line's word and batch five, and under saturation every
    step after was a batch (live, 0.7x the capacity of one at a time). A profile whose gain is clear (the
    embedded model's: 3x) batches everyone from the first step."""
    from stepserve.costs.latency_model import Curve
    from stepserve.costs.line_fit import gain

    points = ((1, 0.1496), (2, 0.2840), (3, 0.4495), (4, 0.5813), (5, 0.7128), (6, 0.8623), (7, 1.0325), (8, 1.0995))
    model = LatencyModel(step={B: Curve(points)}, encode=Curve(((1, 0.0),)), decode={B: Curve(((1, 0.0),))})
    curve = OnlineStepCurve(model, 8)
    assert gain(*curve.line(B), 8) == pytest.approx(1.10, abs=0.01)
    assert curve.efficient_batch(B, 8, 0.01, 0.01, batching=None) == 5  # the line's word alone
    assert curve.decide(B, 8, 0.01, 0.01) == 1 and curve.batching[B] is False
    # on a machine where batching does pay (a batch of 8 gains 2.4x), the steps show it within a few dozen
    shown = OnlineStepCurve(model, 8)
    caps = noisy_caps(shown, 0.10, 0.05, spread=0.0, steps=400, queued=5)
    assert caps[0] == 1 and all(cap == 8 for cap in caps[50:])
    cheap = OnlineStepCurve(prior(0.010, 0.001), 8)
    assert cheap.decide(B, 8, 0.01, 0.01) == 8


def test_steps_that_contradict_the_prior_overturn_it():
    """A profile that says a batch of n costs n steps of one (taken, say, while another process held the
    machine), on a machine where a batch of 8 gains 2.4x: the probes of two show the gain, which the prior's
    points at the sizes never run used to hold down for good (the fit's line through them said a step of two
    costs 0.28 s where it took 0.20 s). A saturated engine now batches within a few probes. Where the probes
    agree with the prior (batching costs more than one at a time, with noisy steps), it stays one at a time
    apart from the probes."""
    from stepserve.costs.latency_model import Curve

    def model(step):
        points = tuple((b, step(b)) for b in range(1, 9))
        return LatencyModel(step={B: Curve(points)}, encode=Curve(((1, 0.0),)), decode={B: Curve(((1, 0.0),))})

    wrong = OnlineStepCurve(model(lambda b: 0.15 * b), 8)
    caps = noisy_caps(wrong, 0.10, 0.05, spread=0.0, steps=400, queued=5)
    first = next(i for i, cap in enumerate(caps) if cap > 2)
    assert 100 <= first <= 250 and all(cap == 8 for cap in caps[first + 20:])
    # after long runs of full batches (no step of one for 1,000 steps) the line is still the machine's
    noisy_caps(wrong, 0.10, 0.05, spread=0.0, steps=1500, queued=5)
    assert wrong.line(B) == pytest.approx((0.10, 0.05), rel=1e-6)
    noisy = noisy_caps(OnlineStepCurve(model(lambda b: 0.15 * b), 8), 0.10, 0.05, spread=0.2, steps=1500, queued=5)
    assert noisy.count(8) > 0.5 * len(noisy)

    rng = random.Random(0)
    from stepserve.scheduling.adaptive import cost_aware_cap

    right = OnlineStepCurve(model(lambda b: 0.15 * b ** 1.05), 8)
    for step in range(1, 1501):
        cap = cost_aware_cap(right, B, [20] * 8, step, queued=5)
        assert cap <= 2 and not right._contradicted(B)
        right.observe(B, cap, 0.15 * cap ** 1.05 * rng.lognormvariate(0, 0.3))
