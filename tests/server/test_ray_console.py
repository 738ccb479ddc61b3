"""The console across replicas through Ray Serve: `stepserve serve --replicas 2` (its own local cluster, loopback)
with max_ongoing_requests 4 per replica. One stream shows both replicas' steps, labelled by replica; open streams
are served by the console's own application and hold none of the replicas' slots; the 17th viewer gets the
console's own 429 through Ray's proxy; and the streams end when the server stops. (The helpers are
ray_cluster.py's.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid

import httpx
import pytest
from extras import require
from ray_cluster import ServeProcess, assert_all_gone, ray_env
from server_helpers import GENERATIONS, assert_error_shape

EVENTS = "/v1/engine/events"

# the first test of the module also starts Ray and its replicas, slow on a busy machine (a hang bound only)
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def fleet_server():
    require("ray", "ray")
    mark = uuid.uuid4().hex
    env = {k: v for k, v in ray_env(mark).items() if k != "RAY_AUTH_MODE"}  # a local cluster: stepserve's default
    server = ServeProcess(mark, "--replicas", "2", "--max-batch-size", "2", "--max-ongoing-requests", "4",
                          "--shutdown-grace-s", "2", env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        server.log.close()
        assert_all_gone(mark)


def collect(url: str, events: list, stop: threading.Event) -> None:
    """(a thread) The stream's (event, data) into `events` until it ends or `stop` is set."""
    with httpx.stream("GET", url + EVENTS, timeout=240) as answer:
        events.append(("status", answer.status_code))
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                events.append((kind, json.loads(line[5:])))
            if stop.is_set():
                return
    events.append(("ended", None))


def wait_for(predicate, what: str, timeout_s: float = 240) -> None:
    """Until predicate() holds; the bound catches a hang only."""
    done = threading.Event()
    while not predicate():
        if done.wait(0.05) or timeout_s <= 0:
            raise AssertionError(f"never: {what}")
        timeout_s -= 0.05


async def post_many(url: str, bodies: list[dict]) -> list:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=240, limits=limits) as client:
        return await asyncio.gather(*(client.post(GENERATIONS, json=b) for b in bodies))


def test_open_streams_hold_no_replica_slot_and_the_17th_viewer_gets_the_consoles_429(fleet_server):
    """8 streams would fill both replicas (4 slots each) if the replicas served them, and an image request would
    then wait in Ray's queue for ever: they are served by the console's application. (First in the module: no
    other viewer is open.)"""
    async def run():
        limits = httpx.Limits(max_connections=24)
        async with httpx.AsyncClient(base_url=fleet_server.url, timeout=240, limits=limits) as client, \
                contextlib.AsyncExitStack() as stack:
            streams = [await stack.enter_async_context(client.stream("GET", EVENTS)) for _ in range(8)]
            assert [s.status_code for s in streams] == [200] * 8
            assert all(s.headers["X-Stepserve-Replica"].startswith("console-") for s in streams)
            image = await client.post(GENERATIONS, json={"prompt": "a two", "num_inference_steps": 4})
            assert image.status_code == 200 and not image.headers["X-Stepserve-Replica"].startswith("console-")
            streams += [await stack.enter_async_context(client.stream("GET", EVENTS)) for _ in range(8)]
            assert [s.status_code for s in streams] == [200] * 16
            async with client.stream("GET", EVENTS) as refused:
                assert refused.status_code == 429
                await refused.aread()
            error = assert_error_shape(refused, 429)  # the console's own answer, not rewritten by Ray's proxy
            assert error["code"] == "too_many_viewers" and refused.headers["Retry-After"] == "10"

    asyncio.run(run())


def test_one_stream_shows_both_replicas_steps_labelled(fleet_server):
    events: list = []
    stop = threading.Event()
    viewer = threading.Thread(target=collect, args=(fleet_server.url, events, stop), daemon=True)
    viewer.start()
    try:
        wait_for(lambda: len(events) >= 2, "the hello")
        assert events[0] == ("status", 200) and events[1][0] == "hello"
        names = events[1][1]["replicas"]
        assert len(names) == 2 and events[1][1]["model"]["name"] == "embedded"
        body = {"prompt": "a seven", "num_inference_steps": 6, "guidance_scale": 1.0}
        # 12 at once: more than one replica's 4 slots, so Ray's router sends them to both
        responses = asyncio.run(post_many(fleet_server.url, [{**body, "seed": i} for i in range(12)]))
        assert [r.status_code for r in responses] == [200] * 12
        served_by = {r.headers["X-Stepserve-Replica"] for r in responses}
        assert served_by == set(names)

        def labels() -> set:
            return {r["replica"] for kind, batch in list(events) if kind == "steps" for r in batch if r["done"]}

        wait_for(lambda: labels() == set(names), "finished requests of both replicas in the stream")
    finally:
        stop.set()


def test_the_streams_end_when_the_server_stops(fleet_server):
    events: list = []
    viewer = threading.Thread(target=collect, args=(fleet_server.url, events, threading.Event()), daemon=True)
    viewer.start()
    wait_for(lambda: len(events) >= 2, "the hello")
    assert fleet_server.stop() == 0, fleet_server.tail()
    viewer.join(240)
    assert events[-1] == ("ended", None)
