"""Policies for the fleet: which replica a request goes to (routers) and how many replicas to run (autoscale),
from plain per-replica stats (predicted seconds of work in hand, adapters held, deadline slack, counts).

Like the engine's batching policies these are pure: no torch, no clock, no I/O. The engine publishes the stats
(work.py: one function from its requests and its cost model to seconds); the simulator, `stepserve plan` and Ray
Serve's request router and autoscaling policy call the same functions.
"""

from .routers import PLANNING_ROUTER, ROUTERS, Router, make_router
from .sent import Sent
from .stats import Job, ReplicaStats, finish_s, price_s, replica_stats
from .work import Tally, work_s

__all__ = ["PLANNING_ROUTER", "ROUTERS", "Job", "ReplicaStats", "Router", "Sent", "Tally", "finish_s", "make_router",
           "price_s", "replica_stats", "work_s"]
