"""Routers: which replica an arriving request goes to, from plain per-replica state.

A router sees only what a load balancer in front of the replicas could know cheaply: how many requests each
replica has outstanding (routed to it and not yet answered). It has no clock and does no I/O, so the same
inputs (and, for the randomised one, the same seed) always give the same choice.

- round_robin: replicas in turn, blind to load. Even spread of requests, not of work: a burst of long requests
  can pile onto one replica while another idles.
- least_outstanding: the replica with the fewest outstanding requests (ties: the lowest index). Needs every
  replica's count at every arrival, which a single balancer has but a fleet of balancers does not.
- power_of_two: two distinct replicas drawn at random, the less loaded of them wins. Mitzenmacher ("The Power of
  Two Choices in Randomized Load Balancing", 1996/2001) showed that sampling only two queues already cuts the
  maximum load from about log n / log log n (one random choice) to log log n / log 2, nearly what looking at all
  of them gives, while each balancer only needs two fresh counts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

ROUTERS = ("round_robin", "least_outstanding", "power_of_two")


def round_robin(turn: int, replicas: int) -> int:
    """The replica whose turn it is: turn 0, 1, 2, ... maps to replica 0, 1, ..., replicas - 1, 0, ..."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return turn % replicas


def least_outstanding(outstanding: Sequence[int]) -> int:
    """The index of the smallest count; ties go to the lowest index."""
    if not outstanding:
        raise ValueError("no replicas to choose from")
    best = 0
    for i in range(1, len(outstanding)):
        if outstanding[i] < outstanding[best]:
            best = i
    return best


def power_of_two(outstanding: Sequence[int], rng: random.Random) -> int:
    """Two distinct replicas drawn from `rng`, the one with fewer outstanding requests (a tie: the lower
    index). With one replica there is nothing to draw."""
    n = len(outstanding)
    if n == 0:
        raise ValueError("no replicas to choose from")
    if n == 1:
        return 0
    a, b = rng.sample(range(n), 2)
    if outstanding[b] < outstanding[a] or (outstanding[b] == outstanding[a] and b < a):
        return b
    return a


class Router(Protocol):
    name: str

    def pick(self, outstanding: Sequence[int]) -> int:
        """The replica for the next arrival, given each replica's outstanding count."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, outstanding: Sequence[int]) -> int:
        i = round_robin(self.turn, len(outstanding))
        self.turn += 1
        return i


class LeastOutstanding:
    name = "least_outstanding"

    def pick(self, outstanding: Sequence[int]) -> int:
        return least_outstanding(outstanding)


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(f"power-of-two-{seed}")

    def pick(self, outstanding: Sequence[int]) -> int:
        return power_of_two(outstanding, self.rng)


def make_router(name: str, seed: int = 0) -> Router:
    """A fresh router by name (one of ROUTERS); `seed` seeds the random draws of power_of_two."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    raise ValueError(f"router: {name!r} is not supported; allowed: {', '.join(ROUTERS)}")
