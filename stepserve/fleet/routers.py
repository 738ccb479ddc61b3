"""Routers: which replica a request goes to, from plain per-replica stats (fleet/stats.py).

Policies for the fleet, as the batching policies are for one engine: no clock, no I/O, so the same inputs (and,
for the randomised ones, the same seed) always give the same choice. The simulator, `stepserve plan` and the
Ray Serve request router (server/ray/router.py) call these same functions.

- least_work (simulate's and plan's default, PLANNING_ROUTER; `serve --replicas N`'s from 3 replicas up,
  serving_router): the replica where the request is predicted to finish first, its own cost included
  (stats.finish_s: the work in hand, the request's price there, the load of any adapter it names that the
  replica does not hold). So a replica that holds the request's adapters wins unless another finishes sooner
  by more than the adapter's load time. Ties: the fewest requests held, then the lowest index.
- least_work_sampled: least_work among `choices` (default 2) replicas drawn at random, plus one drawn among
  those that hold the request's adapters (when it names any and some replica holds them all). For large fleets
  and several routers at once: each needs only a few replicas' stats, and routers working from the same stale
  stats do not all pile onto the one replica that looked least loaded.
- round_robin: replicas in turn, blind to load. Even spread of requests, not of work.
- least_outstanding: the fewest requests held (ties: the lowest index). A 50-step 1024x1024 request counts as
  much as a 4-step 512x512 one.
- power_of_two: two distinct replicas drawn at random, the one holding fewer requests wins (Mitzenmacher, "The
  Power of Two Choices in Randomized Load Balancing", 1996/2001: sampling two queues already cuts the maximum
  load from about log n / log log n to log log n / log 2). Ray Serve's default router works this way.

Model affinity (`model_tiers`, replicas that each serve several models): a request that names its model goes to the
replicas where that model is on the device, else to those holding it in host memory (a move, not a load), and only
then to any, those with the fewest models on their device first; the router's policy picks within the best tier,
the others follow in tier order. As with Ray Serve's
own model multiplexing, a tier is a preference and not a wall: a holder with no room left passes the request on.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from .stats import Job, ReplicaStats, finish_s

ROUTERS = ("least_work", "least_work_sampled", "power_of_two", "least_outstanding", "round_robin")
# the router `stepserve simulate --replicas` and `stepserve plan` assume unless told
PLANNING_ROUTER = "least_work"
DEFAULT_CHOICES = 2
LEAST_WORK_FROM = 3  # `serve --replicas N` routes with least_work from this many replicas up (serving_router)


def serving_router(most_replicas: int) -> str:
    """The router `serve --replicas N` runs unless told: least_work from LEAST_WORK_FROM replicas up (live, with 8
    and 16 replicas, it beat Ray's power of two: docs/SCALING.md, "Live: 8 and 16 simulated replicas"); with 2,
    power of two already compares both replicas at every request, and Ray's own router stays."""
    return PLANNING_ROUTER if most_replicas >= LEAST_WORK_FROM else "power_of_two"


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


def least_work(stats: Sequence[ReplicaStats], job: Job, adapter_load_s: float = 0.0,
               among: Sequence[int] | None = None) -> int:
    """The replica (of `among`, default all) where `job` is predicted to finish first (stats.finish_s); ties:
    the fewest requests held (replicas that have published no curve yet all predict an instant finish), then
    the lowest index."""
    if not stats:
        raise ValueError("no replicas to choose from")
    best, best_key = -1, (0.0, 0)
    for i in range(len(stats)) if among is None else sorted(among):
        key = (finish_s(stats[i], job, adapter_load_s), stats[i].outstanding)
        if best < 0 or key < best_key:
            best, best_key = i, key
    return best


def least_work_sampled(stats: Sequence[ReplicaStats], job: Job, rng: random.Random,
                       choices: int = DEFAULT_CHOICES, adapter_load_s: float = 0.0) -> int:
    """least_work among `choices` distinct replicas drawn from `rng`, plus one drawn among those holding every
    adapter `job` names (if any does)."""
    n = len(stats)
    if n == 0:
        raise ValueError("no replicas to choose from")
    if choices < 1:
        raise ValueError(f"choices must be >= 1, got {choices}")
    among = set(range(n)) if choices >= n else set(rng.sample(range(n), choices))
    if job.adapters:
        holders = [i for i in range(n) if job.adapters <= stats[i].adapters]
        if holders and not among.intersection(holders):
            among.add(rng.choice(holders))
    return least_work(stats, job, adapter_load_s, among)


MODEL_TIERS = ("device", "host")  # where a replica holds a model, best first; anywhere else (disk, loading) is last


def model_tiers(places: Sequence[Mapping[str, str] | None], model: str) -> list[tuple[int, int]] | None:
    """Each replica's tier for a request of `model` (lower is better), from what each replica published (every
    name it serves -> where that model is: "device", "host" or "disk"; None: nothing published yet): (0, 0) where
    it is on the device; else (1, k) in host memory and (2, k) elsewhere, k the models on that replica's device
    (fewer first, as Ray Serve's multiplexing does: less to move off to make room, and two models no replica
    holds spread over the replicas instead of taking turns on one). None when no replica serves a model of that
    name (the name is then an adapter's, or nothing the replicas know): no model affinity."""
    if not model or not any(p and model in p for p in places):
        return None
    tiers = []
    for p in places:
        where = (p or {}).get(model)
        if where == MODEL_TIERS[0]:
            tiers.append((0, 0))
        else:
            on_device = sum(1 for v in (p or {}).values() if v == MODEL_TIERS[0])
            tiers.append((MODEL_TIERS.index(where) if where in MODEL_TIERS else len(MODEL_TIERS), on_device))
    return tiers


def best_tier(tiers: Sequence) -> list[int]:
    """The indices of the replicas in the lowest (best) tier."""
    best = min(tiers)
    return [i for i, t in enumerate(tiers) if t == best]


class Router(Protocol):
    name: str

    def pick(self, stats: Sequence[ReplicaStats], job: Job) -> int:
        """The replica for `job`, given every candidate replica's stats (index into `stats`)."""
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, stats: Sequence[ReplicaStats], job: Job) -> int:
        i = round_robin(self.turn, len(stats))
        self.turn += 1
        return i


class LeastOutstanding:
    name = "least_outstanding"

    def pick(self, stats: Sequence[ReplicaStats], job: Job) -> int:
        return least_outstanding([s.outstanding for s in stats])


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(f"power-of-two-{seed}")

    def pick(self, stats: Sequence[ReplicaStats], job: Job) -> int:
        n = len(stats)
        if n <= 2:
            return power_of_two([s.outstanding for s in stats], self.rng)
        a, b = self.rng.sample(range(n), 2)  # the same draws as power_of_two, reading only the two drawn
        oa, ob = stats[a].outstanding, stats[b].outstanding
        return b if ob < oa or (ob == oa and b < a) else a


class LeastWork:
    name = "least_work"

    def __init__(self, adapter_load_s: float = 0.0) -> None:
        self.adapter_load_s = adapter_load_s

    def pick(self, stats: Sequence[ReplicaStats], job: Job) -> int:
        return least_work(stats, job, self.adapter_load_s)


class LeastWorkSampled:
    name = "least_work_sampled"

    def __init__(self, seed: int = 0, choices: int = DEFAULT_CHOICES, adapter_load_s: float = 0.0) -> None:
        if choices < 1:
            raise ValueError(f"choices must be >= 1, got {choices}")
        self.rng = random.Random(f"least-work-sampled-{seed}")
        self.choices = choices
        self.adapter_load_s = adapter_load_s

    def pick(self, stats: Sequence[ReplicaStats], job: Job) -> int:
        return least_work_sampled(stats, job, self.rng, self.choices, self.adapter_load_s)


def make_router(name: str, seed: int = 0, adapter_load_s: float = 0.0, choices: int = DEFAULT_CHOICES) -> Router:
    """A fresh router by name (one of ROUTERS). `seed` seeds the random draws; `adapter_load_s` is what loading
    an adapter is predicted to cost (least_work*); `choices`: how many replicas least_work_sampled draws."""
    if name == "least_work":
        return LeastWork(adapter_load_s)
    if name == "least_work_sampled":
        return LeastWorkSampled(seed, choices, adapter_load_s)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "power_of_two":
        return PowerOfTwo(seed)
    raise ValueError(f"router: {name!r} is not supported; allowed: {', '.join(ROUTERS)}")
