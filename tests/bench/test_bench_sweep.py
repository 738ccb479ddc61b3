"""The knee: highest rate that held below the first that did not; the search brackets it."""

import asyncio

from stepserve.bench.live import LiveDriver
from stepserve.bench.metrics import StatusCounts
from stepserve.bench.results import SweepPoint
from stepserve.bench.runner import TargetMaker
from stepserve.bench.sweep import SweepSpec, _Sweeper, find_knee, run_sweep
from stepserve.bench.workload import Mix


def pt(rate, held, name="c"):
    return SweepPoint(name, rate, rate, StatusCounts(10, 10, 0, 0, 0), 0.1, 0.2, 0.2 if held else None, rate, rate,
                      1.0 if held else 0.5, held)


def test_find_knee():
    assert find_knee("c", [pt(1, True), pt(2, True), pt(4, False)]).rate_rps == 2
    # a lucky hold above a miss does not count
    assert find_knee("c", [pt(1, True), pt(2, False), pt(3, True)]).rate_rps == 1
    k = find_knee("c", [pt(1, True), pt(2, True)])
    assert k.rate_rps == 2 and k.held_at_top and k.highest_tested_rps == 2
    assert find_knee("c", [pt(1, False)]).rate_rps is None
    assert find_knee("c", [pt(1, True, "other")]).rate_rps is None


def _fake_sweep(monkeypatch, capacity_of, spec):
    async def point(self, maker, rate):
        held = rate <= capacity_of[maker.name]
        self.out.points.append(pt(rate, held, maker.name))
        return held

    monkeypatch.setattr(_Sweeper, "point", point)
    makers = [TargetMaker(name, lambda: None) for name in capacity_of]
    return asyncio.run(run_sweep(LiveDriver(), makers, Mix(), spec, slo_s=1.0, progress=False))


def test_search_climbs_then_bisects(monkeypatch):
    result = _fake_sweep(monkeypatch, {"fast": 7.0, "slow": 2.5},
                         SweepSpec(start_rps=1.0, factor=2.0, max_rps=100.0, refine=3))
    knees = {k.contender: k.rate_rps for k in result.knees}
    # fast: 1, 2, 4 hold, 8 misses, then bisect [4, 8] three times -> within 2**(1/8) of the truth
    assert 7.0 / 2 ** (1 / 8) <= knees["fast"] <= 7.0
    assert 2.5 / 2 ** (1 / 8) <= knees["slow"] <= 2.5
    fast_rates = [p.rate_rps for p in result.points if p.contender == "fast"]
    assert fast_rates[:4] == [1.0, 2.0, 4.0, 8.0] and len(fast_rates) == 7


def test_search_stops_at_the_cap_and_grid_stops_at_first_miss(monkeypatch):
    result = _fake_sweep(monkeypatch, {"c": 1000.0}, SweepSpec(start_rps=1.0, factor=3.0, max_rps=20.0))
    k = result.knees[0]
    assert k.rate_rps == 20.0 and k.held_at_top
    result = _fake_sweep(monkeypatch, {"c": 3.0}, SweepSpec(grid_rps=[4.0, 1.0, 2.0, 8.0]))
    assert [p.rate_rps for p in result.points] == [1.0, 2.0, 4.0]
    assert result.knees[0].rate_rps == 2.0


def test_search_steps_down_when_the_start_rate_misses(monkeypatch):
    result = _fake_sweep(monkeypatch, {"c": 1.5}, SweepSpec(start_rps=8.0, factor=2.0, refine=2))
    rates = [p.rate_rps for p in result.points]
    assert rates[:4] == [8.0, 4.0, 2.0, 1.0]  # down until a hold, then bisect [1, 2]
    assert 1.5 / 2 ** (1 / 4) <= result.knees[0].rate_rps <= 1.5
