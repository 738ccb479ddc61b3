"""Autoscaling on the simulated clock: the fleet grows under a load step and shrinks after it, the replicas it
starts serve only after their start-up, every request is accounted, and replica-seconds are what was paid;
Ray's default policy, as modelled, waits its delays."""

from stepserve.bench.workload import Mix, poisson_trace
from stepserve.costs.latency_model import Curve, LatencyModel
from stepserve.engine.config import EngineOptions
from stepserve.fleet.autoscale import SLOScaling
from stepserve.fleet.routers import make_router
from stepserve.sim.autoscale import RAY_DOWNSCALE_DELAY_S, Autoscaler, RayDefault
from stepserve.sim.fleet import Fleet
from stepserve.sim.loop import Arrival
from stepserve.sim.replicas import COMPLETED, latency_cores, run_replicas, summarize

A = (32, 32)
LINEAR = LatencyModel(step={A: Curve(((1, 0.15), (8, 1.18)))}, encode=Curve(((1, 0.02), (8, 0.16))),
                      decode={A: Curve(((1, 0.08), (8, 0.64)))}, reference_bucket=A)
OPTIONS = EngineOptions("slo", latency_model=LINEAR)
CAPACITY = 1 / (10 * 0.15 + 0.1)  # requests/s of one replica, 10 steps each, one at a time


def step_trace(rates, phase_s, seed=0):
    out = []
    for k, rate in enumerate(rates):
        for it in poisson_trace(Mix.from_steps([10]), rate, phase_s, seed + k).items:
            out.append(Arrival(k * phase_s + it.offset_s, it.spec.to_params()))
    return out


def run(policy, trace, start=1, startup_s=10.0):
    make = lambda r: latency_cores(1, LINEAR, OPTIONS, seed=r)[0]  # noqa: E731
    scaler = Autoscaler(policy, make, startup_s)
    result = run_replicas([make(r) for r in range(start)], trace, Fleet(make_router("least_work"), LINEAR,
                                                                          autoscaler=scaler))
    return result, scaler


def test_the_slo_policy_grows_under_a_step_and_shrinks_after_it():
    trace = step_trace([0.5 * CAPACITY, 3.5 * CAPACITY, 0.5 * CAPACITY], 200.0)
    rule = SLOScaling(slo_s=6.0, low=1, high=6, startup_s=10.0, down_delay_s=20.0)
    result, scaler = run(rule, trace)
    counts = result.replicas
    most = max(n for _, n in counts)
    assert most >= 4 and counts[-1][1] <= 2  # grew under the step, back down after it
    grew_at = next(t for t, n in counts if n >= 4)
    assert 200.0 <= grew_at < 260.0
    assert all(o.status == COMPLETED for o in result.outcomes)  # draining stopped no request
    # a replica serves only after its start-up: nothing reached the new replicas before they were up
    first_new = {o.replica: o.arrival for o in sorted(result.outcomes, key=lambda o: o.arrival) if o.replica >= 1}
    assert all(t >= grew_at for t in first_new.values())
    paid = sum((t1 - t0) * n for (t0, n), (t1, _) in zip(counts, counts[1:] + [(result.end_time, 0)]))
    assert abs(result.replica_s - paid) < 1e-6 and result.replica_s < 6 * result.end_time
    assert summarize(result, 6.0).goodput_frac > 0.8


def test_rays_default_policy_as_modelled_waits_its_delays():
    trace = step_trace([0.5 * CAPACITY, 3.5 * CAPACITY, 0.5 * CAPACITY], 200.0)
    result, _ = run(RayDefault(1.0, 1, 6), trace)
    counts = result.replicas
    grew_at = next(t for t, n in counts if n > 1)
    assert grew_at >= 30.0  # never before upscale_delay_s of wanting more
    # down only after 600 s of wanting fewer: not within the 200 s after the step
    assert RAY_DOWNSCALE_DELAY_S == 600.0 and counts[-1][1] == max(n for _, n in counts) > 1
