"""The profile corrected by observed step times: the ratio follows the machine, per bucket, and leaves the
profile as it is until steps are seen (or when the profile is the all-zero one)."""

from __future__ import annotations

import pytest

from stepserve.costs import CostModel, LatencyModel
from stepserve.costs.drift import DriftCorrected

A, B = (32, 32), (64, 64)
PRIOR = LatencyModel.from_cost_model(CostModel(), buckets=[A, B])


def test_no_steps_no_change():
    model = DriftCorrected(PRIOR)
    for n in (1, 3, 8):
        assert model.step_s(n, A) == PRIOR.step_s(n, A) and model.decode_s(n, B) == PRIOR.decode_s(n, B)
    assert model.encode_s(4) == PRIOR.encode_s(4) and model.reference_bucket == PRIOR.reference_bucket


def test_the_ratio_of_observed_to_predicted_steps_scales_every_prediction():
    model = DriftCorrected(PRIOR, half_life_steps=20)
    for i in range(200):
        n = 1 + i % 8
        model.observe(A, n, 1.5 * PRIOR.step_s(n, A))
    assert model.factor(A) == pytest.approx(1.5)
    assert model.step_s(4, A) == pytest.approx(1.5 * PRIOR.step_s(4, A))
    assert model.decode_s(2, A) == pytest.approx(1.5 * PRIOR.decode_s(2, A))
    assert model.encode_s(2) == pytest.approx(1.5 * PRIOR.encode_s(2))
    assert model.step_s(4, B) == pytest.approx(1.5 * PRIOR.step_s(4, B))  # not seen: all buckets pooled
    for i in range(200):  # B runs at the profile's speed: its own ratio, A's unchanged
        model.observe(B, 2, PRIOR.step_s(2, B))
    assert model.factor(B) == pytest.approx(1.0) and model.factor(A) == pytest.approx(1.5)


def test_a_drift_is_followed_within_a_few_half_lives():
    model = DriftCorrected(PRIOR, half_life_steps=50)
    for _ in range(500):
        model.observe(A, 4, PRIOR.step_s(4, A))
    for _ in range(250):  # five half-lives at twice the cost
        model.observe(A, 4, 2 * PRIOR.step_s(4, A))
    assert 1.9 < model.factor(A) < 2.0


def test_a_zero_profile_and_bad_observations_change_nothing():
    zero = DriftCorrected(LatencyModel.zero())
    zero.observe(A, 2, 0.5)
    assert zero.factor(A) == 1.0 and zero.step_s(2, A) == 0.0
    model = DriftCorrected(PRIOR)
    for bad in (float("nan"), float("inf"), -1.0):
        model.observe(A, 2, bad)
    model.observe(A, 0, 0.5)
    assert model.factor(A) == 1.0
    with pytest.raises(ValueError, match="half_life_steps"):
        DriftCorrected(PRIOR, half_life_steps=0)
