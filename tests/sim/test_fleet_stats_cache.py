"""The simulated fleet reads each replica's stats from a cache kept until the replica's engine or its count of
requests changes: every read a router makes must equal the stats taken from the engine from scratch."""

from __future__ import annotations

import pytest

from stepserve.bench.workload import Mix, poisson_trace
from stepserve.costs.latency_model import Curve, LatencyModel
from stepserve.engine.config import EngineOptions
from stepserve.fleet.routers import make_router
from stepserve.fleet.stats import core_stats
from stepserve.sim.fleet import Fleet
from stepserve.sim.loop import Arrival
from stepserve.sim.replicas import COMPLETED, latency_cores, run_replicas

A = (32, 32)
MODEL = LatencyModel(step={A: Curve(((1, 0.05), (8, 0.12)))}, encode=Curve(((1, 0.002), (8, 0.004))),
                     decode={A: Curve(((1, 0.01), (8, 0.03)))}, reference_bucket=A)


class Checking:
    """A router that checks the stats it is given against the engines' own, then routes as `inner` does."""

    def __init__(self, inner) -> None:
        self.inner, self.name, self.fleet, self.reads = inner, inner.name, None, 0

    def pick(self, stats, job):
        loop = self.fleet.loop
        for i, r in enumerate(self.fleet.routable):
            expected = core_stats(loop.reps[r].core, loop.end_time, MODEL, loop.outstanding[r],
                                  frozenset(self.fleet.adapters[r]))
            expected = self.fleet.sent.adjust(r, expected)
            assert stats[i] == expected, f"replica {r}: stale stats"
            self.reads += 1
        return self.inner.pick(stats, job)


@pytest.mark.parametrize("router,adapter_load_s", [("least_work", 0.0), ("least_work", 0.3),
                                                   ("least_outstanding", 0.0)])
def test_every_stats_read_equals_the_engines_own(router, adapter_load_s):
    trace = poisson_trace(Mix.from_steps([2, 10, 30]), 60.0, 20.0, 3).items
    arrivals = [Arrival(it.offset_s, it.spec.to_params(), adapter=("ink" if i % 3 == 0 else None))
                for i, it in enumerate(trace)]
    checking = Checking(make_router(router, adapter_load_s=adapter_load_s))
    fleet = Fleet(checking, MODEL, adapter_load_s=adapter_load_s)
    checking.fleet = fleet
    cores = latency_cores(4, MODEL, EngineOptions("slo", latency_model=MODEL))
    result = run_replicas(cores, arrivals, fleet)
    assert all(o.status == COMPLETED for o in result.outcomes)
    assert checking.reads == 4 * len(arrivals)
    assert len({o.replica for o in result.outcomes}) == 4  # the load was spread: the stats did change
