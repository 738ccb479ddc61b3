"""The simulated fleet: adapters cost their load where they are not held, the central queue never lets a replica
hold more than it may, a lost replica's requests are accounted as failed, stale stats plus the router's own notes
still spread a burst, and least_work beats the counts where a batch of n costs n steps of one."""

from dataclasses import replace

import pytest

from stepserve.bench.workload import Mix, poisson_trace
from stepserve.costs.latency_model import Curve, LatencyModel
from stepserve.engine.config import EngineOptions
from stepserve.fleet.routers import make_router
from stepserve.sim.fleet import Fleet
from stepserve.sim.loop import Arrival
from stepserve.sim.replicas import COMPLETED, FAILED, latency_cores, run_replicas, summarize

A = (32, 32)
CHEAP = LatencyModel(step={A: Curve(((1, 0.02), (4, 0.035), (8, 0.05)))}, encode=Curve(((1, 0.002), (8, 0.004))),
                     decode={A: Curve(((1, 0.003), (8, 0.008)))}, reference_bucket=A)
LINEAR = LatencyModel(step={A: Curve(((1, 0.15), (8, 1.18)))}, encode=Curve(((1, 0.02), (8, 0.16))),
                      decode={A: Curve(((1, 0.08), (8, 0.64)))}, reference_bucket=A)


def params(steps, **kw):
    return replace(poisson_trace(Mix.from_steps([steps]), 1, 5, 0).items[0].spec.to_params(), **kw)


def test_an_adapter_costs_its_load_where_it_is_not_held_and_least_work_goes_where_it_is():
    trace = [Arrival(0.0, params(10), adapter="ink"), Arrival(1.0, params(10), adapter="ink"),
             Arrival(1.0, params(10)), Arrival(1.01, params(10), adapter="ink")]
    fleet = Fleet(make_router("least_work", adapter_load_s=0.5), CHEAP, adapter_load_s=0.5)
    result = run_replicas(latency_cores(2, CHEAP, EngineOptions("slo", latency_model=CHEAP)), trace, fleet)
    first, again, plain, third = result.outcomes
    assert first.replica == 0 and first.latency > 0.5  # loaded for it
    assert again.replica == 0 and again.latency < 0.5  # held warm on replica 0
    assert plain.replica == 1  # replica 0 is busy with `again`
    assert third.replica == 0  # replica 1 is idle but would pay 0.5 s; 0 finishes sooner
    assert fleet.adapter_loads == 1 and result.adapter_loads == 1
    blind = Fleet(make_router("round_robin"), CHEAP, adapter_load_s=0.5)
    run_replicas(latency_cores(2, CHEAP, EngineOptions("slo", latency_model=CHEAP)), trace, blind)
    assert blind.adapter_loads == 2  # round robin loads it on both


def test_a_replica_holds_no_more_than_the_central_queue_lets_it():
    trace = [Arrival(a.time, a.params) for a in _arrivals(CHEAP, 60, 6, [6, 10, 14])]
    seen = []
    fleet = Fleet(None, CHEAP, central_hold=2)
    cores = latency_cores(3, CHEAP, EngineOptions("continuous"))
    result = run_replicas(cores, trace, fleet, on_step=lambda r, t, rep: seen.append(
        max(len(c.waiting) + len(c.running) + len(c.to_decode) for c in cores)))
    assert max(seen) <= 2 < len(trace)
    assert all(o.status == COMPLETED for o in result.outcomes)
    assert max(o.finish - o.arrival for o in result.outcomes) > 14 * 0.035  # some waited in the central queue


def test_a_lost_replica_fails_what_it_holds_and_takes_no_more():
    trace = _arrivals(CHEAP, 40, 6, [10])
    result = run_replicas(latency_cores(3, CHEAP, EngineOptions("continuous")), trace, make_router("least_work"),
                          failures=[(1, 2.0)])
    s = summarize(result)
    lost = [o for o in result.outcomes if o.replica == 1 and o.status == FAILED]
    assert lost and all(o.finish == 2.0 for o in lost)
    assert not any(o.replica == 1 for o in result.outcomes if o.arrival > 2.0)
    assert s.completed + s.failed == s.offered == len(trace) and s.unfinished == 0
    assert result.lost == [1]


def test_stale_stats_plus_the_routers_own_notes_still_spread_a_burst():
    burst = [Arrival(5.0, params(20)) for _ in range(8)]
    for publish, spread in ((100.0, {0: 2, 1: 2, 2: 2, 3: 2}), (0.0, {0: 2, 1: 2, 2: 2, 3: 2})):
        fleet = Fleet(make_router("least_work"), LINEAR, publish_every_s=publish)
        result = run_replicas(latency_cores(4, LINEAR, EngineOptions("slo", latency_model=LINEAR)), burst, fleet)
        placed = {}
        for o in result.outcomes:
            placed[o.replica] = placed.get(o.replica, 0) + 1
        assert placed == spread, publish


def test_least_work_beats_the_counts_where_a_batch_of_n_costs_n_steps_of_one():
    trace = _arrivals(LINEAR, 0.85 * 4 / (24.7 * 0.15), 900, [4, 20, 50], seed=3)
    p95 = {}
    for name in ("least_work", "least_outstanding", "power_of_two"):
        cores = latency_cores(4, LINEAR, EngineOptions("slo", latency_model=LINEAR))
        p95[name] = summarize(run_replicas(cores, trace, make_router(name, 1)), warmup_s=60).p95_s
    assert p95["least_work"] < 0.85 * p95["power_of_two"] and p95["least_work"] < p95["least_outstanding"]


def _arrivals(model, rate, duration, steps, seed=0):
    trace = poisson_trace(Mix.from_steps(steps), rate, duration, seed)
    return [Arrival(it.offset_s, it.spec.to_params()) for it in trace.items]


def test_a_blind_fleet_prices_every_request_at_the_default_steps_and_size():
    """As behind Ray's proxy when a client sends no x-stepserve-* headers: the request's own steps and size are
    not seen; otherwise they are."""
    cores = latency_cores(2, CHEAP, EngineOptions("slo", latency_model=CHEAP))
    seen, blind = Fleet(make_router("least_work"), CHEAP), Fleet(make_router("least_work"), CHEAP, blind=True)
    for fleet in (seen, blind):
        run_replicas(cores, [Arrival(0.0, params(3))], fleet)
    default = cores[0].model_info.default_steps
    long = params(50, height=64, width=32)
    assert (seen.job(long, None).steps, seen.job(long, None).pixels) == (50, 64 * 32)
    assert (blind.job(long, None).steps, blind.job(long, None).pixels) == (default, 0) and default != 50
