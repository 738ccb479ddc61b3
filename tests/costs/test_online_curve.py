"""The online step curve: its fit, the batch it recommends in each cost regime, and how fast it follows drift."""

from __future__ import annotations

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
