"""What a replica can tell Ray about its load beyond the requests Ray routed to it (no Ray here).

A video job, or an image job asked for with `Prefer: respond-async`, runs on a replica after its POST has been
answered: Ray counts that POST among the replica's ongoing requests only until the answer, so a replica that runs
jobs looks idle to Ray's router and autoscaler. `background_jobs` counts them from the replica's job runner
(stepserve/jobs/runner.py: the jobs it has claimed and runs now), for the replica's routing stats and custom
autoscaling metrics (Ray Serve's record_routing_stats and record_autoscaling_stats, in the fleet's router and
policy).
"""

from __future__ import annotations


def background_jobs(app) -> int:
    """Jobs the app's runner runs now; 0 for an app without jobs (or before it is built)."""
    state = getattr(getattr(app, "state", None), "server", None)
    runner = getattr(getattr(state, "jobs", None), "runner", None)
    return 0 if runner is None else len(runner.running)
