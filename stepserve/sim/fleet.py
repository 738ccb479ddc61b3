"""The fleet in front of the simulated replicas: what the router sees of them (fleet.stats.ReplicaStats from each
engine's own Tally, as a live replica publishes them), where each request goes, and the replicas' adapters.

- Stats. Each replica's stats are what its engine holds (fleet/work.py), priced with the latency model. With
  `publish_every_s` = 0 the router reads them fresh at every arrival; otherwise each replica publishes them every
  that many seconds (as Ray Serve's record_routing_stats does), and the router adds what it sent since
  (fleet/sent.py): the staleness of a live fleet.
- Adapters. A request may name one adapter (sim.loop.Arrival.adapter). A replica holds at most `adapter_slots`
  of them (least recently used dropped first); a request whose adapter the replica does not hold waits
  `adapter_load_s` for it to load (the replica serves the others meanwhile, as the live engine loads adapters off
  its step loop), and a request whose adapter is loading there waits for that load.
- Central queue (`central_hold`): no router, one queue in front of every replica; a replica is sent a request
  only while it holds fewer than `central_hold`, the one with the least work among those that can take one, and
  the rest wait in arrival order. The yardstick a router can approach: a request waits for the first free
  replica instead of committing to one at arrival.
- Lost replicas (`fail`) and autoscaling (sim.autoscale) change which replicas can be routed to.
- Several models per replica (sim.device.Models): a request is placed by what the replica holds for its model
  (Models.stats: the batch it would join is its model's, the work in hand is every model's on that device).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

from ..costs.latency_model import LatencyModel
from ..fleet.routers import Router
from ..fleet.sent import Sent
from ..fleet.stats import Job, ReplicaStats, core_stats, price_s
from ..request.types import SamplingParams


READS_ALL = ("least_work", "least_outstanding")  # routers that read every candidate's stats (the others: a few)


class Fleet:
    def __init__(self, router: Router | None, latency: LatencyModel | None = None, publish_every_s: float = 0.0,
                 adapter_load_s: float = 0.0, adapter_slots: int = 4, central_hold: int | None = None,
                 autoscaler=None, blind: bool = False) -> None:
        """`latency`: what the replicas' stats are priced with (None: each engine's own policy's model);
        `autoscaler`: a sim.autoscale.Autoscaler that starts and drains replicas during the run; `blind`: the
        router prices every request at the default steps and size (as behind Ray's proxy when the client sends
        no x-stepserve-steps / x-stepserve-size headers)."""
        if router is None and central_hold is None:
            raise ValueError("a fleet needs a router, or a central queue (central_hold)")
        if publish_every_s < 0 or adapter_load_s < 0:
            raise ValueError("publish_every_s and adapter_load_s must be >= 0 seconds")
        if central_hold is not None and central_hold < 1:
            raise ValueError(f"central_hold must be >= 1, got {central_hold}")
        self.router, self.latency, self.blind = router, latency, blind
        self.publish_every_s, self.adapter_load_s, self.adapter_slots = publish_every_s, adapter_load_s, adapter_slots
        self.central_hold = central_hold
        self.loop: Any = None
        self.autoscaler = autoscaler
        self.routable: list[int] = []  # replicas a request may be sent to now, in index order
        self.adapters: list[OrderedDict[str, float]] = []  # per replica: adapter -> when it is (was) loaded
        self.adapter_loads = 0  # loads paid, all replicas together
        self.central: deque[tuple] = deque()  # (key, params, adapter, model, arrived at)
        self.until = 0.0  # ticks go on until this time (the last arrival), then while requests are out
        self.sent = Sent()
        self._cache: list[tuple | None] = []  # per replica: (its tally, the tally's version, fresh stats)
        self._published: list[ReplicaStats] = []
        self._periodic: list[list] = []  # [period (math.inf: once), next due, fn(t)]
        self._armed: set[float] = set()  # times a tick is pushed for
        self._default_steps = 0

    def attach(self, loop) -> None:
        self.loop = loop
        for r in range(len(loop.reps)):
            self.joined(r)
        self._default_steps = loop.reps[0].core.model_info.default_steps
        if self.publish_every_s > 0:
            self.every(self.publish_every_s, self._publish)
        if self.autoscaler is not None:
            self.autoscaler.attach(self)
        for e in self._periodic:
            self._arm(e[1])

    def grew(self, r: int) -> None:
        """Replica r was added to the loop (not routable yet: it is starting)."""
        while len(self.adapters) <= r:
            self.adapters.append(OrderedDict())
            self._cache.append(None)
            self._published.append(ReplicaStats())

    def joined(self, r: int) -> None:
        """Replica r (added to the loop) can be routed to."""
        self.grew(r)
        if r not in self.routable:
            self.routable.append(r)
            self.routable.sort()
        self._release(self.loop.end_time)

    def leave(self, r: int) -> None:
        """Replica r takes no more requests (lost, or drained by the autoscaler)."""
        if r in self.routable:
            self.routable.remove(r)
        self.sent.forget(r)

    def fail(self, r: int, t: float) -> None:
        self.leave(r)
        self.loop.fail(r, t)

    # --- stats -------------------------------------------------------------------------------------------------
    def fresh(self, r: int, t: float, model: str | None = None) -> ReplicaStats:
        """Replica r's stats now, from its engine (cached until its tally changes); on a replica of several
        models, as a request for `model` sees them (not cached)."""
        outstanding = self.loop.outstanding[r]
        models = self.loop.reps[r].models
        if models is not None:
            return models.stats(t, model, frozenset(self.adapters[r]))
        cached = self._cache[r]
        if cached is not None and cached[1] == cached[0].version and outstanding == cached[2].outstanding:
            return cached[2]
        core = self.loop.reps[r].core
        stats = core_stats(core, t, self.latency, outstanding, frozenset(self.adapters[r]))
        self._cache[r] = (core.tally, core.tally.version, stats)
        return stats

    def _every_stats(self, candidates: list[int], t: float, model: str | None = None) -> list[ReplicaStats]:
        """stats() of every candidate, in one pass (for the routers that read them all): a replica whose tally
        and count did not change since its stats were last taken is read from the cache without a call."""
        if self.publish_every_s > 0 or self.sent.any() or model is not None:
            return [self.stats(r, t, model) for r in candidates]
        cache, outstanding, out = self._cache, self.loop.outstanding, []
        for r in candidates:
            cached = cache[r]
            if cached is not None and cached[1] == cached[0].version and outstanding[r] == cached[2].outstanding:
                out.append(cached[2])
            else:
                out.append(self.fresh(r, t))
        return out

    def stats(self, r: int, t: float, model: str | None = None) -> ReplicaStats:
        """What the router knows of replica r at t: fresh, or its last publication plus what was sent since."""
        if self.publish_every_s > 0:
            return self.sent.adjust(r, self._published[r])
        if not self.sent.holds(r):
            return self.fresh(r, t, model)
        self.sent.published(r, t)  # fresh: only requests still on their way (an adapter load) are added
        return self.sent.adjust(r, self.fresh(r, t, model))

    def every(self, period_s: float, fn) -> None:
        """Call fn(t) at 0, period_s, 2 x period_s, ... of simulated time, while arrivals are to come or requests
        are out (publications, autoscaling, load samples)."""
        if not period_s > 0:
            raise ValueError(f"a period must be > 0 seconds, got {period_s}")
        self._periodic.append([period_s, 0.0, fn])
        self._arm(0.0)

    def once(self, t: float, fn) -> None:
        """Call fn(t) once, at simulated time t."""
        self._periodic.append([math.inf, t, fn])
        self._arm(t)

    def _arm(self, t: float) -> None:
        if self.loop is not None and t < math.inf and t not in self._armed:
            self._armed.add(t)
            self.loop.tick(max(t, self.loop.end_time))

    def tick(self, t: float) -> None:
        self._armed.discard(t)
        for entry in self._periodic:
            if entry[1] <= t:
                entry[2](t)
                entry[1] += entry[0] * (int((t - entry[1]) // entry[0]) + 1 if entry[0] < math.inf else 1)
        self._periodic = [e for e in self._periodic if e[1] < math.inf]
        later = [e[1] for e in self._periodic if e[0] == math.inf]
        if self.loop.where or t < self.until:
            later += [e[1] for e in self._periodic]
        if later:
            self._arm(min(later))

    def _publish(self, t: float) -> None:
        for r in self.routable:
            self._published[r] = self.fresh(r, t)
            self.sent.published(r, t)

    # --- placement ---------------------------------------------------------------------------------------------
    def job(self, params: SamplingParams, adapter: str | None) -> Job:
        steps = (not self.blind and params.num_inference_steps) or self._default_steps
        pixels = params.height * params.width if params.height and params.width and not self.blind else 0
        return Job(steps, pixels, frozenset((adapter,)) if adapter else frozenset())

    def place(self, t: float, key: int, params: SamplingParams, adapter: str | None,
              model: str | None = None) -> tuple[int, float] | None:
        """(replica, time the request reaches it), or None: it waits in the central queue. `model`: the model it
        names, on replicas of several models."""
        if not self.routable:
            raise RuntimeError("no replica can take requests (all lost or drained)")
        job = self.job(params, adapter)
        if self.central_hold is not None:
            free = [r for r in self.routable if self.loop.outstanding[r] < self.central_hold]
            if not free or self.central:
                self.central.append((key, params, adapter, model, t))
                return None
            return self._send(free, job, t, key, adapter, model)
        return self._send(self.routable, job, t, key, adapter, model)

    def _send(self, candidates: list[int], job: Job, t: float, key: int, adapter: str | None,
              model: str | None = None) -> tuple[int, float]:
        reads_all = self.router is None or self.router.name in READS_ALL
        stats = self._every_stats(candidates, t, model) if reads_all else _Lazy(self, candidates, t, model)
        if self.router is None:  # the central queue: the least work among those that can take one
            from ..fleet.routers import least_work

            i = least_work(stats, job, self.adapter_load_s)
        else:
            i = self.router.pick(stats, job)
        r = candidates[i]
        at = self._adapter_ready(r, adapter, t)
        if self.publish_every_s > 0 or at > t:  # on its way, or not in the published stats: the router's own note
            self.sent.sent(r, key, at, price_s(stats[i], job))
        return r, at

    def _adapter_ready(self, r: int, adapter: str | None, t: float) -> float:
        """When `adapter` is loaded on replica r, loading it (and dropping the least recently used) if need be."""
        if adapter is None:
            return t
        held = self.adapters[r]
        ready = held.get(adapter)
        if ready is None:
            ready = t + self.adapter_load_s
            self.adapter_loads += 1
            held[adapter] = ready
            while len(held) > self.adapter_slots:
                held.popitem(last=False)
            self._cache[r] = None
        held.move_to_end(adapter)
        return max(ready, t)

    def left(self, r: int, key: int, t: float) -> None:
        """Request `key` ended on replica r at t."""
        self.sent.done(r, key)
        self._release(t)

    def withdraw(self, key: int) -> bool:
        """Take `key` out of the central queue (its caller went away); whether it was there."""
        for i, (k, *_) in enumerate(self.central):
            if k == key:
                del self.central[i]
                return True
        return False

    def _release(self, t: float) -> None:
        """Central queue: send waiting requests, in order, while some replica can take one."""
        loop = self.loop
        while self.central and loop is not None:
            free = [r for r in self.routable if loop.outstanding[r] < self.central_hold]
            if not free:
                return
            key, params, adapter, model, arrived = self.central.popleft()
            r, at = self._send(free, self.job(params, adapter), t, key, adapter, model)
            loop.where[key] = r
            loop.outstanding[r] += 1
            loop.deliver(max(at, t), key, _waited(params, t - arrived), r, model)


def _waited(params: SamplingParams, waited_s: float) -> SamplingParams:
    """A request that waited in the central queue has that much less of its timeout left at the replica."""
    if params.timeout_s is None or waited_s <= 0:
        return params
    from dataclasses import replace

    return replace(params, timeout_s=max(params.timeout_s - waited_s, 1e-9))


class _Lazy:
    """The candidates' stats as a sequence, each computed when a router reads it (power_of_two reads two)."""

    __slots__ = ("fleet", "candidates", "t", "model", "got")

    def __init__(self, fleet: Fleet, candidates: list[int], t: float, model: str | None = None) -> None:
        self.fleet, self.candidates, self.t, self.model = fleet, candidates, t, model
        self.got = [None] * len(candidates)

    def __len__(self) -> int:
        return len(self.candidates)

    def __getitem__(self, i: int) -> ReplicaStats:
        s = self.got[i]
        if s is None:
            s = self.got[i] = self.fleet.stats(self.candidates[i], self.t, self.model)
        return s
