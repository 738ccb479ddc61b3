"""The online step curve keeps what each batch size's own steps say (their mean and standard error, and whether
they contradict the prior) until a step of that size is observed: every read must equal one made from scratch."""

from __future__ import annotations

import random

import pytest

from stepserve.costs import CostModel, LatencyModel
from stepserve.costs.online import CONFIDENCE, OnlineStepCurve

B = (32, 32)


def prior(fixed_s: float, per_request_s: float) -> LatencyModel:
    return LatencyModel.from_cost_model(CostModel(step_fixed_s=fixed_s, step_per_item_s=per_request_s / 2))


def from_scratch(curve: OnlineStepCurve) -> OnlineStepCurve:
    """The same sums, none of the kept reads."""
    fresh = OnlineStepCurve(curve.prior, curve.max_batch_size, curve.half_life_steps)
    fresh._seen, fresh._sizes = curve._seen, curve._sizes
    return fresh


@pytest.mark.parametrize("seed", range(4))
def test_kept_reads_equal_reads_from_scratch_after_every_step(seed):
    rng = random.Random(seed)
    curve = OnlineStepCurve(prior(0.0005, 0.070), 8)  # a batch of n costs about n steps of one
    verdicts = set()
    for i in range(600):
        phase = i // 50 % 4  # the steps say: cheap batches (0, 1) or what the prior says (2, 3); only ones in 1, 3
        b = 1 if phase in (1, 3) else rng.choice([1, 2, 4, 8])
        a, c = (0.010, 0.002) if phase < 2 else (0.0005, 0.070)
        curve.observe(B, b, (a + c * b) * rng.lognormvariate(0.0, 0.1))
        scratch = from_scratch(curve)
        assert curve.fit(B) == scratch.fit(B)
        assert curve._contradicts(B) == scratch._contradicts(B)
        verdicts.add(curve._contradicts(B))
        ones = scratch._mean_se(B, 1)
        for n, kept in curve._size_verdict.get(B, {}).items():  # each size's kept verdict, as of now
            assert kept == scratch._size_contradicts(B, n, ones)
        for n in range(2, 9):
            assert curve.size_gain_bounds(B, n, CONFIDENCE) == scratch.size_gain_bounds(B, n, CONFIDENCE)
    assert verdicts == {False, True}  # both answers were read from kept verdicts


def test_the_fit_is_the_line_through_the_merged_sums_exactly():
    """fit() sums the prior's and the observed points in one pass (Sums.plus); the line is bit for bit the one
    through both merged into empty sums, the prior first."""
    from stepserve.costs.line_fit import Sums, fit_line

    rng = random.Random(7)
    curve = OnlineStepCurve(prior(0.010, 0.002), 8)
    for _ in range(300):
        b = rng.choice([1, 3, 8])
        curve.observe(B, b, (0.010 + 0.002 * b) * rng.lognormvariate(0.0, 0.3))
        merged = Sums()
        merged.merge(curve._prior_sums(B))
        merged.merge(curve._seen[B])
        if not curve._contradicted(B):
            assert curve.fit(B) == fit_line(merged)


def test_an_observed_step_adds_to_the_sums_exactly_as_scale_then_add():
    from stepserve.costs.line_fit import Sums

    rng = random.Random(3)
    fused, apart = Sums(), Sums()
    for _ in range(200):
        b, t, f = rng.choice([1, 2, 5, 8]), rng.lognormvariate(-3.0, 1.0), rng.choice([0.5 ** (1 / 30), 0.5 ** 0.1])
        fused.decay_add(f, b, t)
        apart.scale(f)
        apart.add(b, t)
        assert fused == apart
