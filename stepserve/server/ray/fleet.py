"""What a replica tells Ray Serve about its load, and the autoscaling policy that reads it.

- `routing_stats(engine)`: the replica's stats (fleet.stats.core_stats: its engine's work in hand priced by its own
  latency model, adapters loaded, deadline slack, background video jobs), stamped with when they were taken; Ray
  Serve's controller asks for them (`record_routing_stats`) and hands them to the routers (router.py).
- `autoscaling_stats(engine)`: the same work in hand and jobs as numbers (`record_autoscaling_stats`), which Ray
  Serve gives a custom autoscaling policy as `raw_metrics`.
- `SLOAutoscaling`: that policy (`--autoscale MIN:MAX --slo-p95-ms X`): the fleet's own rule (fleet/autoscale.py)
  on the latest work in hand of each running replica. Ray Serve chooses which replica stops, so the policy never
  lowers the count while any replica runs a background job (a stopped replica would cut it short).
"""

from __future__ import annotations

import time
from typing import Any

from ...fleet.autoscale import SLOScaling, decide
from ...fleet.stats import ReplicaStats, core_stats

POLICY_FUNCTION = "stepserve.server.ray.fleet:SLOAutoscaling"
LOOK_BACK_S = 10.0  # Ray Serve keeps the replicas' metrics this long (its default is 30 s)


def engine_stats(engine, jobs: int | None = None) -> ReplicaStats | None:
    """`jobs`: the background jobs the replica's job runner runs (server/ray/load.py); None: its engine's videos."""
    if engine is None:
        return None
    return core_stats(engine.core, engine.clock.now(), adapters=engine.model_info.lora_names, jobs=jobs)


def routing_stats(engine, jobs: int | None = None) -> dict[str, Any]:
    stats = engine_stats(engine, jobs)
    return published(stats, engine.model_info.default_steps if stats is not None else 0)


def published(stats: ReplicaStats | None, default_steps: int | None, models: dict[str, str] | None = None) -> dict:
    """What a replica publishes for the routers: its stats, when they were taken, the default steps its requests
    are priced at (None: no model loaded to say) and, serving several models, where each is (replica_models.py)."""
    if stats is None:  # still starting: nothing to say yet
        return {}
    out = stats.to_dict()
    out["taken_at"] = time.time()  # the routers' clock for what they sent since (fleet/sent.py)
    if default_steps is not None:
        out["default_steps"] = default_steps
    if models is not None:
        out["models"] = models
    return out


def autoscaling_stats(engine, jobs: int | None = None) -> dict[str, float]:
    return autoscaling_of(engine_stats(engine, jobs))


def autoscaling_of(stats: ReplicaStats | None) -> dict[str, float]:
    if stats is None:
        return {}
    return {"work_s": float(stats.work_s), "jobs": float(stats.jobs), "outstanding": float(stats.outstanding)}


class SLOAutoscaling:
    """Ray Serve's custom autoscaling policy (AutoscalingPolicy.policy_function, policy_kwargs: the SLOScaling
    fields): called with an AutoscalingContext, returns (replicas, state)."""

    def __init__(self, **settings: Any) -> None:
        self.rule = SLOScaling(**settings)

    def __call__(self, ctx) -> tuple[int, dict]:
        raw = ctx.raw_metrics or {}
        running = list(ctx.running_replicas)
        stats = [ReplicaStats(work_s=_latest(raw.get("work_s", {}).get(r)),
                              outstanding=int(_latest(raw.get("outstanding", {}).get(r))),
                              jobs=int(round(_latest(raw.get("jobs", {}).get(r))))) for r in running]
        starting = max(int(ctx.target_num_replicas) - len(running), 0)
        state = dict(ctx.policy_state or {})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        want = decide(stats, starting, now, self.rule, state)
        have = len(running) + starting
        if want < have and any(s.jobs for s in stats):
            want = have  # Ray picks the replica to stop: never while one runs a job
        return want, state


def _latest(series) -> float:
    """The most recent value of a Ray Serve metric time series (0 when there is none)."""
    if not series:
        return 0.0
    return float(max(series, key=lambda p: p.timestamp).value)
