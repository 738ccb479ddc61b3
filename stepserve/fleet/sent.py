"""What a router has sent to each replica since that replica last published its stats.

A replica's stats are taken at one moment and reach the routers later (Ray Serve: every publication period, via
its controller), so on their own they miss whatever was sent in between: a burst would see the same least
loaded replica over and over. A router therefore keeps its own prediction of each request it sends (the price
it computed) and adds, to a replica's published stats, the requests it sent after those stats were taken and
that have not come back yet (`Sent.adjust`). When newer stats arrive, what they already count is dropped.

Times are given by the caller, on one clock for the sends and the stats' `taken_at` stamps (wall-clock seconds
across machines). Pure data: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable

from .stats import ReplicaStats, with_sent


class Sent:
    """Per replica: request key -> (sent at, predicted seconds), for the requests sent and not yet answered."""

    def __init__(self) -> None:
        self._out: dict[Hashable, dict[Hashable, tuple[float, float]]] = {}
        self._taken: dict[Hashable, float] = {}  # per replica: when its latest stats were taken

    def sent(self, replica: Hashable, request: Hashable, at: float, seconds: float) -> None:
        self._out.setdefault(replica, {})[request] = (at, seconds)

    def done(self, replica: Hashable, request: Hashable) -> None:
        """The request came back (answered, failed or cancelled): its work is no longer ahead of anyone."""
        out = self._out.get(replica)
        if out is not None:
            out.pop(request, None)

    def published(self, replica: Hashable, taken_at: float) -> None:
        """Stats of `replica` taken at `taken_at` arrived: requests sent by then are in them."""
        if taken_at <= self._taken.get(replica, float("-inf")):
            return
        self._taken[replica] = taken_at
        out = self._out.get(replica)
        if out:
            for key in [k for k, (at, _) in out.items() if at <= taken_at]:
                del out[key]

    def forget(self, replica: Hashable) -> None:
        """The replica is gone."""
        self._out.pop(replica, None)
        self._taken.pop(replica, None)

    def holds(self, replica: Hashable) -> bool:
        """Whether anything sent to `replica` is noted."""
        return bool(self._out.get(replica))

    def any(self) -> bool:
        """Whether anything sent to any replica is noted."""
        return any(self._out.values())

    def pending(self, replica: Hashable) -> tuple[int, float]:
        """(requests, predicted seconds) sent to `replica` since its latest stats and not yet answered."""
        out = self._out.get(replica)
        if not out:
            return 0, 0.0
        return len(out), sum(s for _, s in out.values())

    def adjust(self, replica: Hashable, stats: ReplicaStats) -> ReplicaStats:
        """The replica's stats with what was sent since they were taken added."""
        n, seconds = self.pending(replica)
        return with_sent(stats, n, seconds)
