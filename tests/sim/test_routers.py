"""Routers pick a replica from plain per-replica counts: round-robin cycles, least-outstanding takes the minimum
(ties: lowest index), power-of-two is seeded and never takes the busier of its two draws."""

import random

import pytest

from stepserve.sim.routers import (
    ROUTERS,
    LeastOutstanding,
    PowerOfTwo,
    RoundRobin,
    least_outstanding,
    make_router,
    power_of_two,
    round_robin,
)


def test_round_robin_cycles_whatever_the_load():
    router = RoundRobin()
    picks = [router.pick([9, 0, 5]) for _ in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]
    assert [round_robin(t, 4) for t in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError):
        round_robin(0, 0)


def test_least_outstanding_picks_the_minimum_ties_by_index():
    assert least_outstanding([3, 1, 2]) == 1
    assert least_outstanding([2, 1, 1, 0, 0]) == 3
    assert least_outstanding([4, 4, 4]) == 0
    assert LeastOutstanding().pick([1, 0]) == 1
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
        counts = [counts_rng.randrange(6) for _ in range(5)]
        pick = power_of_two(counts, rng)
        a, b = rng.drawn[-1]
        assert pick in (a, b) and a != b
        assert counts[pick] == min(counts[a], counts[b])


def test_power_of_two_is_deterministic_per_seed():
    counts = [[i % 3, (i * 7) % 5, 2, (i * 3) % 4] for i in range(200)]
    first = [PowerOfTwo(3).pick(c) for c in counts]  # a fresh router per pick: same first draw every time
    assert first == [PowerOfTwo(3).pick(c) for c in counts]
    one, two = PowerOfTwo(3), PowerOfTwo(3)
    assert [one.pick(c) for c in counts] == [two.pick(c) for c in counts]
    other = PowerOfTwo(4)
    again = PowerOfTwo(3)
    assert [again.pick(c) for c in counts] != [other.pick(c) for c in counts]
    assert power_of_two([7], random.Random(0)) == 0


def test_make_router_names_and_errors():
    for name in ROUTERS:
        assert make_router(name, 1).name == name
    with pytest.raises(ValueError, match="allowed: round_robin, least_outstanding, power_of_two"):
        make_router("random")
