"""What a replica tells Ray of its load beyond the requests Ray routed to it: the jobs its runner runs after their
POST was answered (stepserve/server/ray/load.py; the replica's background_jobs())."""

from __future__ import annotations

from types import SimpleNamespace

from stepserve.server.ray.load import background_jobs


def test_background_jobs_counts_what_the_runner_runs_and_is_0_without_jobs(tiny_executor):
    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.server.app import create_app

    app = create_app(AsyncEngine(tiny_executor))
    assert background_jobs(None) == 0  # a replica whose app is not built yet
    runner = SimpleNamespace(running={"vid_1": object(), "imgjob_2": object()})  # the runner's jobs by id
    app.state.server.jobs = SimpleNamespace(runner=runner)
    assert background_jobs(app) == 2
    del runner.running["vid_1"]  # a job ended
    assert background_jobs(app) == 1
