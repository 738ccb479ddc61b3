"""Event streams of jobs: one store read serves every follower of a job (not one per stream), and a process
serves a bounded number of streams (429 past it)."""

from __future__ import annotations

import asyncio

import pytest
from job_helpers import CountingStore, app_client

from stepserve.engine.loading import load_executor
from stepserve.jobs.changes import Changes, follow
from stepserve.store import JobRecord
from stepserve.store.memory import MemoryStore


def test_one_poll_of_the_store_serves_every_follower_of_a_job():
    store = CountingStore(MemoryStore())
    store.create_job(JobRecord("j", "video", {}, store.now()))
    first = store.get_job("j")
    store.update_job("j", status="in_progress", progress=40)  # changed by a process elsewhere

    async def scenario():
        changes = Changes(store, poll_s=0.01)
        streams = [follow(changes, "j", first) for _ in range(5)]
        assert [(await s.__anext__()).progress for s in streams] == [0] * 5  # the job as each stream began
        seen = [(await s.__anext__()).progress for s in streams]
        for s in streams:
            await s.aclose()
        return seen, changes

    calls = len(store.calls)
    seen, changes = asyncio.run(scenario())
    assert seen == [40] * 5 and store.calls[calls:] == ["get_job"]  # one read for the five
    assert changes.following == 0 and changes._polls == {}  # the poll ends with its last follower


def test_a_process_serves_a_bounded_number_of_job_event_streams():
    with app_client(load_executor("embedded")) as c:
        c.app.state.server.jobs.runner.claiming = False
        job = c.post("/v1/images/generations", json={"prompt": "a", "num_inference_steps": 2},
                     headers={"Prefer": "respond-async"}).json()
        c.app.state.server.jobs.changes.max_followers = 0
        refused = c.get(f"/v1/images/jobs/{job['id']}/events")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_streams", refused.text
    assert refused.headers["retry-after"] == "5"


def test_streams_let_in_count_before_their_bodies_start():
    """A burst: each stream is counted when its route lets it in, not when its body starts (after the head), so
    the bound holds however many arrive at once; one whose body never starts stops counting after a while."""
    changes = Changes(None, max_followers=2)
    assert changes.reserve() and changes.reserve() and not changes.reserve()
    changes._reserved = [t - 3600 for t in changes._reserved]  # their clients left before the bodies started
    assert changes.reserve()
