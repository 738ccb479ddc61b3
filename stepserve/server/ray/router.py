"""`serve --replicas N --router least_work|least_work_sampled|...`: Ray Serve's request router running the fleet's
own routers (stepserve/fleet/routers.py) on the stats each replica publishes.

- Each replica publishes its stats (fleet.stats.ReplicaStats: seconds of work in hand from its engine's own
  latency model, the steps a newcomer would run at, adapters loaded, tightest deadline slack, background jobs)
  through Ray Serve's `record_routing_stats`, stamped with the time they were taken. Ray's controller asks for them
  every ROUTING_STATS_PERIOD_S and hands them to the routers, so they are that old, and a little more.
- Between publications the router adds what it sent since (fleet/sent.py): each request's price there, as this
  router last quoted it, from the moment Ray sends it (`on_send_request`) until stats taken after it arrive or a
  request to that replica comes back (`on_request_completed`; Ray calls `on_request_routed` only when replicas may
  refuse requests, which stepserve's deployment does not ask for).
- A request counts at a replica once its engine holds it. Until then (on its way, in Ray's queue or the replica's
  HTTP layer) the published stats miss it, and its note is dropped as soon as stats taken after the send arrive.
  So the requests this router has out there and not back (`on_send_request` to `on_request_completed`) are a
  floor on what a replica holds (`with_in_flight`); without it, live runs on a loaded machine let a replica slow
  to take requests in look emptier than it was and draw ever more.
- A replica that has published nothing yet (just started, as when the autoscaler adds one) is priced at a
  published sibling's step costs, holding nothing: at no cost at all it would predict an instant finish and draw
  every request until its first stats arrive.
- Ray's HTTP proxy routes a request before reading its body. A client that knows its request's work says it in
  two headers, `x-stepserve-steps: 50` and `x-stepserve-size: 1024x1024` (`stepserve bench --target` sends them),
  which the router reads from the request's ASGI scope (the argument the proxy hands the replica), and prices the
  request at its own steps and pixels. Without them it prices each request that generates (GENERATING_ROUTES; a
  job's polls and event streams cost nothing) at the model's default steps and reference size (what each
  replica quotes). The replicas' work in hand, which is what differs between them, is exact either way. A
  client that names its LoRA adapter in Ray's `serve_multiplexed_model_id` header gets adapter affinity (a
  replica holding it wins unless another finishes sooner by more than --adapter-load-s).
- Several models per replica: each replica also publishes where it holds each model it serves (device, host
  memory, disk: replica_models.py). A request whose `serve_multiplexed_model_id` header names one of those models
  gets model affinity (fleet/routers.py, model_tiers): the router's policy picks among the replicas holding it on
  their device, else in host memory, else among all (those with the fewest models on their device first); the
  other replicas follow in that order. A model this router sent a request of counts as on that replica's device
  while the request is out and until stats taken after it came back arrive (a model with requests in flight never
  leaves the device), so the next request of that model follows it instead of loading it on another replica.
  The header names a model when a replica serves one of that name, else a LoRA adapter as above.
- The choice is one rank per replica, best first; Ray then sends to the first that has room (its
  max_ongoing_requests), as it does for its own routers.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import random
import time
from collections import deque
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from ...fleet.routers import DEFAULT_CHOICES, best_tier, make_router, model_tiers
from ...fleet.sent import Sent
from ...fleet.headers import work_of_headers
from ...fleet.stats import Job, ReplicaStats, finish_s, price_s, with_in_flight

ROUTING_STATS_PERIOD_S = 0.5  # how often Ray's controller asks each replica for its stats
log = logging.getLogger(__name__)
ROUTER_CLASS = "stepserve.server.ray.router.FleetRouter"
MAX_QUOTES = 4096  # ranked requests kept until sent (one that never is, given up by its client, ages out)
# The routes whose POST makes work (Ray's proxy matches each request to the app's route pattern, and the router sees
# that pattern). Every other request costs nothing here: health, models, a job's polls and event streams
# (GET /v1/videos/{video_id}, .../events, /v1/images/jobs/{job_id}), listings, adapter loads.
GENERATING_ROUTES = frozenset(("/v1/images/generations", "/v1/images/edits", "/v1/videos"))


def generates(route: str, method: str = "") -> bool:
    """Whether a request makes work, from its route pattern and, where Ray gives it, its HTTP method (GET
    /v1/videos lists; only POST creates). A request whose route is unknown ("": a call through a handle; "/": the
    prefix, before the replicas have told the proxy their routes) is priced as one that does: the safe side."""
    if method and method.upper() != "POST":
        return False
    path = route.rstrip("/")
    return not path or path in GENERATING_ROUTES


def scope_headers(pending: PendingRequest) -> list[tuple[bytes, bytes]]:
    """The HTTP headers of a request as Ray's proxy hands it on (an HTTP request's first argument is the proxy's
    pickled StreamingHTTPRequest holding the ASGI scope); [] for anything else (a call through a handle, whose
    arguments are never unpickled here). A scope that cannot be read is said once in the log: every request is
    then priced at the defaults."""
    args = getattr(pending, "args", ())
    if not getattr(pending.metadata, "is_http_request", False) or not args or not isinstance(args[0], bytes):
        return []
    try:
        scope = pickle.loads(args[0]).asgi_scope
        return list(scope.get("headers", ()))
    except Exception as exc:  # noqa: BLE001 - Ray's private request shape changed: price at the defaults
        global _UNREADABLE
        if not _UNREADABLE:
            _UNREADABLE = True
            log.warning("the router cannot read a request's headers (%s: %s): every request is priced at the "
                        "model's default steps and size", type(exc).__name__, exc)
        return []


_UNREADABLE = False


class FleetRouter(FIFOMixin, RequestRouter):
    """A Ray Serve RequestRouter that ranks replicas with a stepserve router (kwargs: router, adapter_load_s,
    choices, default_steps, seed)."""

    def initialize_state(self, router: str = "least_work", adapter_load_s: float = 0.0,
                         choices: int = DEFAULT_CHOICES, default_steps: int = 20, seed: int | None = None,
                         **_: Any) -> None:
        self.policy = make_router(router, random.randrange(2**31) if seed is None else seed, adapter_load_s,
                                  choices)
        self.adapter_load_s = adapter_load_s
        self.default_steps = default_steps
        self.sent = Sent()
        self._stats: dict[Any, ReplicaStats] = {}  # replica id -> its stats as last ranked
        # a published replica's step costs: how a replica that has published nothing yet is priced (holding nothing)
        self._costs: dict[str, Any] = {}
        # requests ranked and not yet sent, oldest first: internal id -> (the request, its job, the model it names)
        self._quotes: dict[str, tuple[PendingRequest, Job, str | None]] = {}
        # replica id -> (its note in Sent, the model it brings, its price), oldest first
        self._notes: dict[Any, deque] = {}
        self._count = itertools.count()
        # replica id -> model -> [requests of it out there, when the last came back]: on that replica's device
        self._brought: dict[Any, dict[str, list]] = {}

    def job(self, pending: PendingRequest | None) -> Job:
        if pending is None:
            return Job(self.default_steps)
        meta = pending.metadata
        adapter = meta.multiplexed_model_id
        adapters = frozenset((adapter,)) if adapter else frozenset()
        if not generates(meta.route, getattr(meta, "_http_method", "")):
            return Job(0, 0, adapters)
        steps, pixels = work_of_headers(scope_headers(pending))
        return Job(steps or self.default_steps, pixels, adapters)

    def stats_of(self, replica: RunningReplica) -> ReplicaStats:
        """The replica's published stats plus what this router sent it since they were taken, holding at least
        what this router has out there."""
        rid = replica.replica_id
        published = replica.routing_stats or {}
        if not published.get("curve"):  # none yet (just started, or no model loaded): a sibling's costs, no work
            published = {**published, **self._costs}
        taken = published.get("taken_at")
        if taken is not None:
            self.sent.published(rid, float(taken))
        stats = self.sent.adjust(rid, ReplicaStats.from_dict(published))
        notes = self._notes.get(rid, ())
        each = sum(n[2] for n in notes) / len(notes) if notes else 0.0
        return with_in_flight(stats, len(notes), each)

    def places_of(self, replica: RunningReplica) -> dict[str, str] | None:
        """Where the replica holds each model it serves (published), with the models this router sent it requests
        of counted as on its device while those are out and until stats taken after they came back arrive; None:
        it serves one model, or published nothing yet."""
        rid = replica.replica_id
        published = replica.routing_stats or {}
        places = published.get("models")
        brought = self._brought.get(rid)
        if brought:
            taken = float(published.get("taken_at", float("-inf")))
            for model in [m for m, (out, back) in brought.items() if not out and back <= taken]:
                del brought[model]  # in the stats now
            if brought:
                places = {**(places or {}), **dict.fromkeys(brought, "device")}
        return places

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        published = next((r.routing_stats for r in candidate_replicas if r.routing_stats), {})
        self.default_steps = int(published.get("default_steps", self.default_steps))  # the model's, as served
        costed = next((r.routing_stats for r in candidate_replicas if (r.routing_stats or {}).get("curve")), None)
        if costed:  # with several models per replica: the costs of whichever model that replica quotes now
            self._costs = {k: costed[k] for k in ("curve", "fixed_s", "pixels") if k in costed}
        job = self.job(pending_request)
        stats = [self.stats_of(r) for r in candidate_replicas]
        named = next(iter(job.adapters), "")
        tiers = model_tiers([self.places_of(r) for r in candidate_replicas], named) if named else None
        model = None if tiers is None or not job.steps else named
        if tiers is None:
            tiers = [(0, 0)] * len(stats)
            first = self.policy.pick(stats, job)
        else:
            job = Job(job.steps, job.pixels)  # the name is a model's, not an adapter's
            among = best_tier(tiers)
            first = among[self.policy.pick([stats[i] for i in among], job)]
        scored = sorted(range(len(stats)),
                        key=lambda i: (i != first, tiers[i], finish_s(stats[i], job, self.adapter_load_s)))
        for i, replica in enumerate(candidate_replicas):
            self._stats[replica.replica_id] = stats[i]
        if pending_request is not None:
            key = pending_request.metadata.internal_request_id
            self._quotes.setdefault(key, (pending_request, job, model))
            if len(self._quotes) > MAX_QUOTES:  # done ones go first: given up, or sent where a replica died since
                for dead in [k for k, (p, _, _) in self._quotes.items() if p.future.done()]:
                    del self._quotes[dead]
                if len(self._quotes) > MAX_QUOTES:  # the oldest are next to go out: this one is priced by default
                    del self._quotes[key]
        return [[candidate_replicas[i]] for i in scored]

    def sent_request(self, replica_id) -> tuple[Job, str | None]:
        """(the job, the model it names) of the ranked request Ray just gave `replica_id`: Ray's FIFO queue hands a
        replica to the oldest pending request, which need not be the one it was chosen for, so it is found by the
        replica its future holds. The model's default job when none is found (a request never ranked here)."""
        dead, found = [], None
        for key, (pending, job, model) in self._quotes.items():  # the oldest first: the one sent is near the front
            future = pending.future
            if not future.done():
                continue
            if _given_up(future):
                dead.append(key)
            elif getattr(future.result(), "replica_id", None) == replica_id:
                dead.append(key)
                found = job, model
                break
        for key in dead:
            del self._quotes[key]
        return found or (Job(self.default_steps), None)

    def on_send_request(self, replica_id) -> None:
        """Ray calls this as it sends a request to `replica_id`: noted at that request's price there."""
        super().on_send_request(replica_id)
        job, model = self.sent_request(replica_id)
        price = price_s(self._stats.get(replica_id) or ReplicaStats(), job)
        key = next(self._count)
        now = time.time()
        self.sent.sent(replica_id, key, now, price)
        self._notes.setdefault(replica_id, deque()).append((key, model, price))
        if model:
            self._brought.setdefault(replica_id, {}).setdefault(model, [0, now])[0] += 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        """A request to `replica_id` came back: its oldest note goes (the count of those out stays right)."""
        notes = self._notes.get(replica_id)
        if notes:
            key, model, _ = notes.popleft()
            self.sent.done(replica_id, key)
            brought = self._brought.get(replica_id, {}).get(model)
            if brought is not None:
                brought[0], brought[1] = max(brought[0] - 1, 0), time.time()

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.sent.forget(replica_id)
        self._notes.pop(replica_id, None)
        self._stats.pop(replica_id, None)
        self._brought.pop(replica_id, None)


def _given_up(future) -> bool:
    """A ranked request's future that will never be sent: cancelled (its client left) or failed."""
    return future.done() and (future.cancelled() or future.exception() is not None)


def router_config(router: str, adapter_load_s: float) -> dict | None:
    """Ray Serve's request_router_config for `--router` (None: power_of_two is Ray's own default router)."""
    if router == "power_of_two":
        return None
    return {"request_router_class": ROUTER_CLASS,
            "request_router_kwargs": {"router": router, "adapter_load_s": adapter_load_s},
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
            "request_routing_stats_timeout_s": 10.0}
