"""Routers pick a replica from plain per-replica stats: round-robin cycles, least-outstanding takes the minimum
count (ties: lowest index), power-of-two is seeded and never takes the busier of its two draws, least_work takes
the replica where the request is predicted to finish first, adapters included."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepserve.fleet.routers import (
    PLANNING_ROUTER,
    ROUTERS,
    LeastOutstanding,
    PowerOfTwo,
    RoundRobin,
    least_outstanding,
    least_work,
    least_work_sampled,
    make_router,
    power_of_two,
    round_robin,
)
from stepserve.fleet.stats import Job, ReplicaStats, finish_s, price_s

JOB = Job(20)


def counts(*n):
    return [ReplicaStats(outstanding=k) for k in n]


def test_round_robin_cycles_whatever_the_load():
    router = RoundRobin()
    picks = [router.pick(counts(9, 0, 5), JOB) for _ in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]
    assert [round_robin(t, 4) for t in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError):
        round_robin(0, 0)


def test_least_outstanding_picks_the_minimum_ties_by_index():
    assert least_outstanding([3, 1, 2]) == 1
    assert least_outstanding([2, 1, 1, 0, 0]) == 3
    assert least_outstanding([4, 4, 4]) == 0
    assert LeastOutstanding().pick(counts(1, 0), JOB) == 1
    with pytest.raises(ValueError):
        least_outstanding([])


class _Spy(random.Random):
    """Records the two replicas each draw took."""

    def __init__(self, seed):
        super().__init__(seed)
        self.drawn = []

    def sample(self, population, k):
        pair = super().sample(population, k)
        self.drawn.append(pair)
        return pair


def test_power_of_two_never_picks_the_busier_of_its_two():
    counts_rng = random.Random(1)
    rng = _Spy(5)
    for _ in range(500):
        c = [counts_rng.randrange(6) for _ in range(5)]
        pick = power_of_two(c, rng)
        a, b = rng.drawn[-1]
        assert pick in (a, b) and a != b
        assert c[pick] == min(c[a], c[b])


def test_power_of_two_is_deterministic_per_seed_and_draws_as_the_function_does():
    loads = [counts(i % 3, (i * 7) % 5, 2, (i * 3) % 4) for i in range(200)]
    one, two = PowerOfTwo(3), PowerOfTwo(3)
    assert [one.pick(c, JOB) for c in loads] == [two.pick(c, JOB) for c in loads]
    same = random.Random("power-of-two-3")
    assert [PowerOfTwo(3).pick(c, JOB) for c in loads[:1]] == [power_of_two([s.outstanding for s in loads[0]], same)]
    other, again = PowerOfTwo(4), PowerOfTwo(3)
    assert [again.pick(c, JOB) for c in loads] != [other.pick(c, JOB) for c in loads]
    assert power_of_two([7], random.Random(0)) == 0


def test_least_work_sends_where_the_request_finishes_first_not_where_fewest_wait():
    # one at a time (a curve of one size): replica 0 holds one long request (8 s of work), replica 1 three short
    # ones (1.5 s); counts say 0, the work says 1
    one = (0.1,)
    stats = [ReplicaStats(outstanding=1, work_s=8.0, curve=one), ReplicaStats(outstanding=3, work_s=1.5, curve=one)]
    assert least_outstanding([s.outstanding for s in stats]) == 0
    assert least_work(stats, Job(20)) == 1
    assert finish_s(stats[1], Job(20)) == pytest.approx(1.5 + 20 * 0.1)  # all of the work first, then its own
    assert least_work([ReplicaStats(), ReplicaStats()], JOB) == 0  # a tie: the lowest index
    with pytest.raises(ValueError):
        least_work([], JOB)


def test_where_batching_is_cheap_a_newcomer_runs_at_once_in_a_larger_batch():
    curve = (0.004, 0.0054, 0.007, 0.008)  # up to 4 at once, each step cheaper per request
    busy = ReplicaStats(outstanding=2, work_s=0.3, curve=curve)  # a free place: it starts now, at batch 3
    assert finish_s(busy, Job(20)) == pytest.approx(20 * 0.007)
    full = ReplicaStats(outstanding=6, work_s=0.6, curve=curve)  # 3 of 6 must finish to free a place
    assert finish_s(full, Job(20)) == pytest.approx(0.6 * 3 / 6 + 20 * 0.008)
    idle = ReplicaStats(curve=curve)
    assert least_work([busy, idle, full], Job(20)) == 1
    assert price_s(busy, Job(20)) == pytest.approx(20 * 0.007 / 3)  # its share of the batches it runs in


def test_a_request_of_another_size_is_priced_by_its_pixels():
    s = ReplicaStats(curve=(0.1,), fixed_s=0.2, pixels=512 * 512)
    assert finish_s(s, Job(10, 1024 * 1024)) == pytest.approx(4 * (10 * 0.1 + 0.2))
    assert finish_s(s, Job(10)) == pytest.approx(10 * 0.1 + 0.2)


def test_adapter_holder_wins_unless_another_finishes_sooner_by_more_than_the_load():
    job = Job(10, adapters=frozenset({"ink"}))
    holder = ReplicaStats(outstanding=1, work_s=3.0, curve=(0.1,), adapters=frozenset({"ink"}))
    for other_work, load_s, winner in [(2.5, 1.0, 0), (1.5, 1.0, 1), (2.0, 1.0, 0), (0.0, 5.0, 0), (0.0, 2.0, 1)]:
        stats = [holder, ReplicaStats(outstanding=1, work_s=other_work, curve=(0.1,))]
        assert least_work(stats, job, load_s) == winner, (other_work, load_s)


def test_a_request_that_would_push_a_deadline_over_goes_elsewhere():
    tight = ReplicaStats(outstanding=1, work_s=1.0, curve=(0.1,), slack_s=0.5)  # 0.5 s before a request is late
    loose = ReplicaStats(outstanding=1, work_s=1.4, curve=(0.1,))
    assert least_work([tight, loose], Job(10)) == 1  # 1 s of its own would make the tight one 0.5 s late
    assert least_work([tight, loose], Job(2)) == 0  # 0.2 s fits in the slack


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0.001, 1), st.integers(0, 20)), min_size=1, max_size=12),
       st.integers(1, 60))
def test_least_work_never_picks_a_replica_predicted_to_finish_later(replicas, steps):
    stats = [ReplicaStats(outstanding=n, work_s=w, curve=(row, row * 1.5)) for w, row, n in replicas]
    job = Job(steps)
    pick = least_work(stats, job)
    assert all(finish_s(stats[pick], job) <= finish_s(s, job) for s in stats)


def test_sampled_least_work_reads_only_its_draws_and_adds_an_adapter_holder():
    rng = random.Random(7)
    stats = [ReplicaStats(outstanding=1, work_s=float(10 - i), curve=(0.1,)) for i in range(10)]
    for _ in range(200):
        state = rng.getstate()
        pick = least_work_sampled(stats, JOB, rng, choices=2)
        rng2 = random.Random()
        rng2.setstate(state)
        drawn = rng2.sample(range(10), 2)
        assert pick == max(drawn)  # the less loaded of its two draws
    held = [ReplicaStats(1, work_s=1.0, curve=(0.1,)) for _ in range(9)] + [
        ReplicaStats(1, work_s=1.5, curve=(0.1,), adapters=frozenset({"ink"}))]
    job = Job(5, adapters=frozenset({"ink"}))
    assert all(least_work_sampled(held, job, random.Random(s), 2, adapter_load_s=2.0) == 9 for s in range(50))
    assert least_work_sampled(held, JOB, random.Random(0), choices=20) == 0  # more choices than replicas: all
    with pytest.raises(ValueError):
        least_work_sampled(held, JOB, random.Random(0), choices=0)


def test_make_router_names_and_errors():
    assert PLANNING_ROUTER == "least_work"
    for name in ROUTERS:
        assert make_router(name, 1).name == name
    with pytest.raises(ValueError, match="allowed: least_work, least_work_sampled, power_of_two"):
        make_router("random")
