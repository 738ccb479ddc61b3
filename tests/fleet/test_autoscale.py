"""The SLO autoscaling rule: replicas for the work arriving and for the backlog against the SLO, up at once,
down only after a delay, never below MIN or above MAX, and never stopping a replica that runs a job."""

import pytest

from stepserve.fleet.autoscale import SLOScaling, decide, pick_to_stop
from stepserve.fleet.stats import ReplicaStats

RULE = SLOScaling(slo_s=10.0, low=1, high=6, startup_s=30.0, down_delay_s=60.0)


def fleet(*work):
    return [ReplicaStats(outstanding=1 if w else 0, work_s=w) for w in work]


def test_adds_replicas_when_the_backlog_per_replica_passes_half_the_slo():
    assert decide(fleet(4.0, 4.0), 0, 0.0, RULE, {}) == 2  # 4 s each: within 5 s
    assert decide(fleet(9.0, 9.0), 0, 0.0, RULE, {}) == 4  # 18 s of work: 4 replicas hold it at 4.5 s each
    assert decide(fleet(90.0, 90.0), 0, 0.0, RULE, {}) == 6  # never above MAX
    assert decide(fleet(9.0, 9.0), 2, 0.0, RULE, {}) == 4  # two starting already count


def test_follows_the_work_arriving_not_the_requests():
    """Two busy replicas whose backlog holds steady drain 2 s of work a second: that much arrives; at 80%
    utilisation it takes 3 replicas. The same work in a third of the requests asks for the same count."""
    state = {}
    for t in range(0, 60):
        want = decide([ReplicaStats(outstanding=9, work_s=3.0), ReplicaStats(outstanding=9, work_s=3.0)], 0,
                      float(t), RULE, state)
    assert want == 3
    state = {}
    for t in range(0, 60):
        want = decide([ReplicaStats(outstanding=3, work_s=3.0), ReplicaStats(outstanding=3, work_s=3.0)], 0,
                      float(t), RULE, state)
    assert want == 3


def test_removes_replicas_only_after_the_work_stayed_low_for_the_delay():
    state, n, history = {}, 4, []
    for t in range(0, 200, 5):
        n = decide(fleet(*([0.0] * n)), 0, float(t), RULE, state)
        history.append(n)
    assert history[0] == 4 and history[-1] == 1
    first_drop = next(i for i, v in enumerate(history) if v < 4)
    assert first_drop * 5 >= 60  # not before the delay
    assert decide(fleet(0.0), 0, 500.0, RULE, state) == 1  # never below MIN
    assert decide(fleet(0.0, 0.0), 1, 900.0, RULE, {}) == 3  # nothing goes while a replica is starting


def test_a_burst_resets_the_slow_way_down():
    state = {}
    decide(fleet(0.0, 0.0, 0.0), 0, 0.0, RULE, state)
    decide(fleet(0.0, 0.0, 0.0), 0, 50.0, RULE, state)
    n = decide(fleet(6.0, 6.0, 6.0), 0, 55.0, RULE, state)
    assert n >= 4  # up at once (18 s of work)
    assert decide(fleet(*[0.0] * n), 0, 70.0, RULE, state) == n  # the delay starts again


def test_the_replica_to_stop_runs_no_job_and_has_the_least_work():
    stats = [ReplicaStats(work_s=0.0, jobs=1), ReplicaStats(work_s=2.0), ReplicaStats(work_s=1.0)]
    assert pick_to_stop(stats) == 2
    assert pick_to_stop([ReplicaStats(jobs=2)]) is None


def test_bad_settings_say_what_is_allowed():
    with pytest.raises(ValueError, match="MIN <= MAX"):
        SLOScaling(slo_s=1.0, low=3, high=2)
    with pytest.raises(ValueError, match="SLO"):
        SLOScaling(slo_s=0.0)
    with pytest.raises(ValueError, match="utilisation"):
        SLOScaling(slo_s=1.0, utilisation=1.5)
