"""What the fleet knows of a replica (`ReplicaStats`) and of a request being placed (`Job`), and the prediction a
router makes from them: when the job would finish on that replica (`finish_s`).

A replica makes its stats with `replica_stats` from its engine's Tally (fleet/work.py) and its own latency model;
a live replica publishes them (Ray Serve's record_routing_stats), the simulator reads them from its engines. With
them the replica quotes the step costs a newcomer would run at (`curve`: a step of its reference bucket at batch
1, 2, ... up to the batch the replica runs at once), so a router needs no cost model of its own: a request of
another size is priced in proportion to its pixels.

Pure data and arithmetic: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..costs.latency_model import Curve, LatencyModel
from ..request.buckets import Bucket, bucket_pixels
from .work import FRESH, HELD, work_s

INF = math.inf
MIN_GAIN = 0.10  # batching that gains less throughput than this runs one at a time (scheduling/adaptive.py's rule)


@dataclass(slots=True)
class ReplicaStats:
    """One replica, as a router or the autoscaler sees it."""

    outstanding: int = 0  # requests it holds (sent to it and not answered)
    work_s: float = 0.0  # predicted seconds to finish everything it holds (fleet/work.py)
    curve: tuple[float, ...] = ()  # a denoising step of `pixels` at batch 1, 2, ... up to what it runs at once
    fixed_s: float = 0.0  # a request's seconds besides its steps (encoding its prompt, decoding its image)
    pixels: int = 0  # the request size that `curve` and `fixed_s` price (0: any request the same)
    adapters: frozenset[str] = frozenset()  # adapters loaded there now
    slack_s: float = INF  # its tightest deadline minus now minus work_s: how much later that request may finish
    jobs: int = 0  # background jobs (videos) running there: the autoscaler never stops such a replica

    def to_dict(self) -> dict:
        """JSON-ready (what a live replica publishes); slack_s infinite -> None."""
        d = {k: getattr(self, k) for k in ("outstanding", "work_s", "fixed_s", "pixels", "jobs")}
        d["curve"] = list(self.curve)
        d["adapters"] = sorted(self.adapters)
        d["slack_s"] = None if math.isinf(self.slack_s) else self.slack_s
        return d

    @classmethod
    def from_dict(cls, data: Mapping) -> ReplicaStats:
        """What to_dict wrote; missing fields take their defaults (a replica that published nothing yet)."""
        slack = data.get("slack_s")
        return cls(outstanding=int(data.get("outstanding", 0)), work_s=float(data.get("work_s", 0.0)),
                   curve=tuple(float(x) for x in data.get("curve", ())), fixed_s=float(data.get("fixed_s", 0.0)),
                   pixels=int(data.get("pixels", 0)), adapters=frozenset(data.get("adapters", ())),
                   slack_s=INF if slack is None else float(slack), jobs=int(data.get("jobs", 0)))


@dataclass(frozen=True)
class Job:
    """A request being placed: its denoising steps, its size in pixels (0: the replicas' reference size) and the
    adapters it names."""

    steps: int
    pixels: int = 0
    adapters: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, steps: int, bucket: Bucket | None = None, adapters=()) -> Job:
        return cls(int(steps), bucket_pixels(bucket) if bucket else 0, frozenset(adapters))


def _joins(stats: ReplicaStats, job: Job) -> tuple[int, float, float]:
    """(the batch `job` would run in, its seconds per step there, its fixed seconds), scaled by its pixels."""
    scale = job.pixels / stats.pixels if job.pixels and stats.pixels else 1.0
    if not stats.curve:
        return 1, 0.0, stats.fixed_s * scale
    b = min(stats.outstanding + 1, len(stats.curve))
    return b, stats.curve[b - 1] * scale, stats.fixed_s * scale


def price_s(stats: ReplicaStats, job: Job) -> float:
    """Predicted seconds of work `job` adds to the replica (its share of the batches it runs in)."""
    b, step, fixed = _joins(stats, job)
    return (job.steps * step + fixed) / b


def finish_s(stats: ReplicaStats, job: Job, adapter_load_s: float = 0.0) -> float:
    """Seconds from now until `job` would be done on this replica: the wait for a place in its batches, its own
    steps at the batch it joins, the load of each adapter it names that the replica does not hold, and whatever
    it would push the replica's tightest deadline past (an admitted request's lateness counts as much as the
    newcomer's).

    The replica runs up to len(curve) requests at once. Below that the newcomer starts at once and takes every
    step of a batch one larger than what the replica holds; at it or above, it waits while that share of the
    work in hand is done which frees a place: all of it where the replica runs one request at a time (a batch
    of n costs about n steps of one, so it does not batch: first come first served), a fraction where it runs
    several."""
    # _joins, inline (the router calls this for every replica at every arrival); read once: price_s's terms too
    n, curve = stats.outstanding, stats.curve
    scale = job.pixels / stats.pixels if job.pixels and stats.pixels else 1.0
    if curve:
        b = min(n + 1, len(curve))
        step, fixed = curve[b - 1] * scale, stats.fixed_s * scale
    else:
        b, step, fixed = 1, 0.0, stats.fixed_s * scale
    cap = max(len(curve), 1)
    wait = 0.0 if n < cap else stats.work_s * (n - cap + 1) / n
    missing = sum(1 for a in job.adapters if a not in stats.adapters) if job.adapters else 0
    late = max((job.steps * step + fixed) / b - stats.slack_s, 0.0)  # price_s
    return wait + job.steps * step + fixed + missing * adapter_load_s + late


def runs_at_once(latency: LatencyModel, bucket: Bucket, max_batch: int, cost_aware: bool = True) -> int:
    """How many requests a replica runs in one step: max_batch, or 1 where a cost-aware policy finds that
    batching gains less than MIN_GAIN throughput (a batch of max_batch costs about max_batch steps of one)."""
    if not cost_aware or max_batch <= 1:
        return max(max_batch, 1)
    one, full = latency.step_s(1, bucket), latency.step_s(max_batch, bucket)
    return 1 if full <= 0 or max_batch * one / full < 1.0 + MIN_GAIN else max_batch


def replica_stats(loads: Mapping[Bucket, list[int]], latency: LatencyModel, max_batch: int,
                  outstanding: int | None = None, adapters=frozenset(), earliest_deadline: float | None = None,
                  now: float = 0.0, jobs: int = 0, cost_aware: bool = True) -> ReplicaStats:
    """The stats of a replica whose engine holds `loads` (a Tally's snapshot), predicts with `latency` and runs
    up to `max_batch` at once (fewer where `cost_aware` and batching does not pay: runs_at_once).
    `earliest_deadline` (absolute, on the clock of `now`): the tightest deadline among its requests."""
    work = work_s(loads, latency, max_batch)
    curve, fixed, pixels = _quote(latency, max_batch, cost_aware)
    count = sum(v[HELD] for v in loads.values()) if outstanding is None else outstanding
    slack = INF if earliest_deadline is None else earliest_deadline - now - work
    return ReplicaStats(count, work, curve, fixed, pixels, frozenset(adapters), slack, jobs)


_QUOTES: dict[tuple, tuple] = {}  # fixed latency models only (a drift-corrected one changes as it learns)


def _quote(latency, max_batch: int, cost_aware: bool) -> tuple[tuple[float, ...], float, int]:
    """(curve, fixed_s, pixels) a replica quotes for a newcomer of its reference bucket."""
    key = (id(latency), max_batch, cost_aware)
    hit = _QUOTES.get(key) if type(latency) is LatencyModel else None
    if hit is not None and hit[0] is latency:
        return hit[1]
    ref = latency.reference_bucket
    cap = runs_at_once(latency, ref, max_batch, cost_aware)
    quote = (tuple(latency.step_s(b, ref) for b in range(1, cap + 1)), latency.decode_s(1, ref) + latency.encode_s(1),
             bucket_pixels(ref))
    if type(latency) is LatencyModel:
        if len(_QUOTES) > 64:
            _QUOTES.clear()
        _QUOTES[key] = (latency, quote)
    return quote


def core_stats(core, now: float, latency=None, outstanding: int | None = None, adapters=frozenset(),
               jobs: int | None = None) -> ReplicaStats:
    """The stats of an engine core (its tally, policy and deadlines: engine/core.py, read duck-typed) predicted
    with `latency`, by default its policy's own latency model (the slo policy's, corrected by the steps it saw);
    without one, every step costs 1 s at any batch size: the bare count of remaining steps."""
    policy = core.policy
    if latency is None:
        latency = getattr(policy, "latency_model", None)
        if latency is None or latency.metadata.get("source") == "zero":
            latency = STEPS_ONLY
    cost_aware = bool(getattr(policy, "cost_aware", False)) or policy.name == "adaptive"
    loads = core.tally.snapshot()
    if jobs is None:  # a video (frames > 1) runs as a background job: count them from what the engine holds
        jobs = sum(v[HELD] for b, v in loads.items() if len(b) == 3 and b[0] > 1)
    return replica_stats(loads, latency, policy.max_batch_size, outstanding, adapters, core.earliest_deadline(),
                         now, jobs, cost_aware)


STEPS_ONLY = LatencyModel(step={(1, 1): Curve(((1, 1.0),))}, encode=Curve(((1, 0.0),)),
                          decode={(1, 1): Curve(((1, 0.0),))}, metadata={"source": "steps only"})


def with_sent(stats: ReplicaStats, requests: int, seconds: float) -> ReplicaStats:
    """`stats` plus requests a router sent since they were taken (its own predictions of their seconds)."""
    if not requests and not seconds:
        return stats
    return replace(stats, outstanding=stats.outstanding + requests, work_s=stats.work_s + seconds,
                   slack_s=stats.slack_s - seconds)


def with_in_flight(stats: ReplicaStats, in_flight: int, seconds_each: float) -> ReplicaStats:
    """`stats` holding at least the `in_flight` requests a router knows it has out there (sent and not answered):
    a request on its way, in the server's queue or HTTP layer, is not in the engine's stats yet, so a replica slow
    to take requests in would otherwise look emptier than it is. Each one missing counts `seconds_each`."""
    missing = in_flight - stats.outstanding
    return stats if missing <= 0 else with_sent(stats, missing, missing * seconds_each)


__all__ = ["FRESH", "HELD", "INF", "Job", "ReplicaStats", "finish_s", "price_s", "replica_stats", "with_in_flight",
           "with_sent"]
