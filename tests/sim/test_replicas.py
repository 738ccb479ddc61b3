"""Replicas behind a router on one simulated clock: every arrival ends in exactly one state, a second replica
cuts the p95 of a load that overloads one, and one replica reproduces the single-engine simulator."""

from dataclasses import replace

import pytest

from stepserve.engine.config import EngineOptions
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.costs.latency_model import Curve, LatencyModel
from stepserve.sim import Arrival, simulate
from stepserve.sim.replicas import (
    COMPLETED,
    FAILED,
    REJECTED,
    UNFINISHED,
    allowed_misses,
    latency_cores,
    run_replicas,
    summarize,
)
from stepserve.fleet.routers import make_router

A = (32, 32)
# about 16 requests/s per replica at batch 8 and 10 steps
MODEL = LatencyModel(step={A: Curve(((1, 0.02), (4, 0.035), (8, 0.05)))}, encode=Curve(((1, 0.002), (8, 0.004))),
                     decode={A: Curve(((1, 0.003), (8, 0.008)))}, reference_bucket=A)
MIX = Mix.from_steps([6, 10, 14])


def arrivals(rate, duration, seed=0, timeout_s=None):
    trace = poisson_trace(MIX, rate, duration, seed).with_timeout(timeout_s)
    return [Arrival(it.offset_s, it.spec.to_params()) for it in trace.items]


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding", "power_of_two"])
def test_nothing_is_lost_across_replicas(router):
    trace = arrivals(60, 10, timeout_s=0.8)
    cores = latency_cores(3, MODEL, EngineOptions("continuous", max_queue=4))
    result = run_replicas(cores, trace, make_router(router, 1))
    statuses = [o.status for o in result.outcomes]
    assert len(statuses) == len(trace)
    assert set(statuses) <= {COMPLETED, REJECTED, FAILED} and statuses.count(COMPLETED) > len(trace) // 2
    assert REJECTED in statuses or FAILED in statuses  # the load was meant to overflow somewhere
    assert {o.replica for o in result.outcomes} == {0, 1, 2}
    assert all(o.finish is not None and o.finish >= o.arrival for o in result.outcomes)
    assert not any(c.has_work() for c in cores)
    s = summarize(result, slo_s=0.8)
    assert s.completed + s.rejected + s.failed + s.unfinished == s.offered == len(trace)

    cut = run_replicas(latency_cores(3, MODEL, EngineOptions("continuous")), arrivals(90, 10), make_router(router),
                       stop_at=6.0)
    ended = [o for o in cut.outcomes if o.status != UNFINISHED]
    assert len(cut.outcomes) == len(arrivals(90, 10))
    assert all(o.finish <= 6.0 for o in ended) and len(ended) < len(cut.outcomes)
    assert all(o.replica == -1 for o in cut.outcomes if o.arrival > 6.0)


def test_a_second_replica_cuts_the_p95_of_an_overload():
    trace = arrivals(24, 20)
    p95 = {}
    for n in (1, 2):
        result = run_replicas(latency_cores(n, MODEL, EngineOptions("continuous")), trace,
                              make_router("least_outstanding"), stop_at=30.0)
        p95[n] = summarize(result).p95_s
    assert p95[2] < 1.0 < p95[1]


@pytest.mark.parametrize("options", [EngineOptions("continuous"), EngineOptions("dynamic", max_queue_delay_ms=30),
                                     EngineOptions("static", max_queue=6)])
def test_one_replica_equals_the_single_engine_simulator(options):
    trace = arrivals(20, 8, seed=4)
    alone = simulate(latency_cores(1, MODEL, options)[0], [replace(a) for a in trace])
    fleet = run_replicas(latency_cores(1, MODEL, options), trace, make_router("power_of_two", 9))
    assert [r.timing.finished for r in alone.requests] == [o.finish for o in fleet.outcomes]
    assert [r.status.value for r in alone.requests] == [o.status for o in fleet.outcomes]
    assert len(fleet.outcomes) == len(trace) > 100


def test_stopping_early_once_the_p95_cannot_hold():
    trace = arrivals(40, 20)
    limit = allowed_misses(len(trace))
    result = run_replicas(latency_cores(1, MODEL, EngineOptions("continuous")), trace,
                          make_router("least_outstanding"), stop_at=40.0, slo_s=0.5, miss_limit=limit)
    assert result.stopped_early and summarize(result, 0.5).p95_s > 0.5
    assert allowed_misses(100) == 5 and allowed_misses(19) == 0 and allowed_misses(0) == 0

def test_a_caller_that_goes_away_behind_a_router_frees_its_slot():
    """An abort reaches the replica the request was routed to; one before the arrival itself is ignored."""
    params = replace(arrivals(40, 1)[0].params, num_inference_steps=14)
    trace = [Arrival(0.0, params, abort_at=0.1), Arrival(0.0, params), Arrival(0.5, params, abort_at=0.2)]
    result = run_replicas(latency_cores(2, MODEL, EngineOptions("continuous")), trace, make_router("round_robin"))
    aborted, kept, late = result.outcomes
    assert (aborted.replica, kept.replica, late.replica) == (0, 1, 0)
    assert aborted.status == FAILED and aborted.finish < kept.finish
    assert kept.status == COMPLETED and late.status == COMPLETED
