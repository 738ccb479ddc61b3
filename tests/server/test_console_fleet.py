"""The console across replicas, without Ray: the hub merges the replicas' step records for every reader, each
record names its replica, and one stream shows every replica's lanes (fleet_helpers.py stands in for the actors
and Ray's proxy). tests/server/test_ray_console.py checks the same through Ray Serve."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from fleet_helpers import EVENTS, fleet

from stepserve.server.ray.events_hub import STALE_S, EventsHub


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(replica: str, t: float, done=()) -> dict:
    return {"t": t, "dt": 0.01, "rows": [[1, 2, 4]], "joined": [], "paused": [], "done": list(done), "queue": 0,
            "running": 1, "cap": 4, "replica": replica}


def test_the_hub_merges_two_replicas_records_for_its_readers():
    clock = Clock()
    hub = EventsHub(clock)

    async def run():
        clock.now += 2.0
        assert hub.join("a", {"model": {"name": "m"}, "max_batch_size": 4, "strategy": "slo",
                              "recent": [["completed", 0.5, 4]]}) == 2.0  # its records count from the hub's start
        hub.join("b", {"model": {"name": "m"}, "max_batch_size": 4, "strategy": "slo", "recent": []})
        assert hub.put("a", json.dumps([record("a", 2.0)])) == 0  # no reader: the replica stops sending
        assert not await hub.wait_watched("a", 0)
        waiting = asyncio.ensure_future(hub.wait_watched("b", 3600))  # a replica waits for a viewer ...
        await asyncio.sleep(0)
        cursor, items, closed = await hub.read("r1", None, 0)  # ... and a reader arrives: it wakes at once
        assert await waiting and (items, closed) == ([], False) and hub.watching() == 1
        reading = asyncio.ensure_future(hub.read("r1", cursor, 3600))  # a long poll ...
        await asyncio.sleep(0)
        assert not reading.done()
        batch_a = json.dumps([record("a", 2.1, done=[[1, "completed", 0.7, 4]])])
        assert hub.put("a", batch_a) == 1  # ... answered by the first batch
        cursor, items, _ = await reading
        assert items == [("steps", batch_a)]
        batch_b = json.dumps([record("b", 2.2), record("b", 2.3)])
        hub.put("b", batch_b)
        hub.put("a", None)  # a sign of life adds nothing
        cursor, items, _ = await hub.read("r1", cursor, 0)
        assert items == [("steps", batch_b)]
        hello = hub.hello()
        assert hello["replicas"] == ["a", "b"] and hello["model"] == {"name": "m"} and hello["t"] == 2.0
        assert sorted(hello["recent"]) == [["completed", 0.5, 4], ["completed", 0.7, 4]]  # both replicas'
        hub.leave("b")
        cursor, items, _ = await hub.read("r1", cursor, 0)
        assert items == [("replicas", ["a"])]
        clock.now += STALE_S + 1  # a replica killed without a word drops out
        cursor, items, _ = await hub.read("r1", cursor, 0)
        assert items == [("replicas", [])] and hub.hello()["replicas"] == []
        assert hub.put("a", batch_a) == 0  # refused, and told to stop: it sends again once it joins again
        assert (await hub.read("r1", cursor, 0))[1] == []
        late = asyncio.ensure_future(hub.read("r2", None, 3600))
        await asyncio.sleep(0)
        hub.close()  # the server is stopping: every read answers closed
        assert (await late)[2] is True and await hub.wait_watched("a", 3600) is None  # replicas: nothing to send
        hub.unread("r1")
        hub.unread("r2")
        assert hub.watching() == 0

    asyncio.run(run())


@pytest.fixture(scope="module")
def make_app():
    """An app over its own engine on the embedded model (each replica loads its own copy)."""
    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.engine.loading import load_executor
    from stepserve.server.app import create_app

    return lambda key: create_app(AsyncEngine(load_executor("embedded"), strategy="continuous", max_batch_size=4),
                                  api_key=key, shutdown_grace_s=5.0)


def read_stream(url: str, headers: dict, until, events: list) -> None:
    """Append (event, data) of the stream at `url` to `events` until `until(events)` or the stream ends."""
    with httpx.stream("GET", url, headers=headers, timeout=240) as answer:
        assert answer.status_code == 200, answer.read()
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                events.append((kind, json.loads(line[5:])))
                if until(events):
                    return


def until(predicate) -> None:
    """Wait for the server's state (the test's timeout bounds a hang)."""
    while not predicate():
        threading.Event().wait(0.02)


def done_by_replica(events) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind, data in events:
        for r in data if kind == "steps" else ():
            counts[r["replica"]] = counts.get(r["replica"], 0) + len(r["done"])
    return counts


def test_one_stream_shows_every_replicas_steps_labelled_and_ends_when_the_server_stops(make_app):
    key = {"Authorization": "Bearer k"}
    with fleet(make_app, api_key="k") as f:
        assert httpx.get(f.url + EVENTS, timeout=30).status_code == 401  # behind the key, like every /v1 route
        names = sorted(f.urls)
        events: list = []
        body = {"prompt": "a seven", "num_inference_steps": 5, "n": 3, "seed": 1}

        def send():  # once the viewer watches: the replicas then send every step
            until(lambda: f.console.viewers and f.hub.call("watching"))
            for url in f.urls.values():
                assert httpx.post(url + "/v1/images/generations", json=body, headers=key, timeout=240).status_code \
                    == 200

        sender = threading.Thread(target=send)
        sender.start()
        read_stream(f.url + EVENTS, key, lambda ev: all(done_by_replica(ev).get(n, 0) >= 3 for n in names), events)
        sender.join()
        kind, hello = events[0]
        assert kind == "hello" and hello["replicas"] == names and hello["model"]["name"] == "embedded"
        steps = [r for kind, batch in events if kind == "steps" for r in batch]
        assert {r["replica"] for r in steps} == set(names)
        hub_now = f.hub.call("now")
        for name in names:  # per replica: its own ids, one per request from joining to leaving, on the hub's clock
            mine = [r for r in steps if r["replica"] == name]
            joined = {i for r in mine for i in r["joined"]}
            assert len(joined) == 3 and {d[0] for r in mine for d in r["done"]} == joined
            assert all(0 <= r["t"] <= hub_now for r in mine)
            assert [r["t"] for r in mine] == sorted(r["t"] for r in mine)

        later: list = []  # a viewer who comes later sees both replicas' finished requests in its hello
        read_stream(f.url + EVENTS, key, lambda ev: True, later)
        assert [r[0] for r in later[0][1]["recent"]].count("completed") >= 6

        ended = threading.Event()
        last: list = []
        viewer = threading.Thread(target=lambda: [read_stream(f.url + EVENTS, key, lambda ev: False, last),
                                                  ended.set()], daemon=True)
        viewer.start()
        until(lambda: last)  # it has its hello
        assert not ended.is_set()
        f.hub.call("close")  # the server stops: the stream ends (it would hold the shutdown otherwise) ...
        assert ended.wait(240)
        for forwarder in f.forwarders:  # ... and the replicas stop forwarding (not polling a closed hub in a loop)
            assert forwarder.result(240) is None


def test_viewers_who_come_and_go_leave_the_stream_working_for_the_next(make_app):
    """The last viewer leaving stops the console's read loop; the next viewer starts another and gets records.
    (A read loop cancelled while it awaited the hub failed like a lost hub, and ended every later stream after its
    hello.)"""
    with fleet(make_app, names=("replica-a",)) as f:
        first: list = []
        read_stream(f.url + EVENTS, {}, lambda ev: True, first)  # a hello, then the viewer leaves
        until(lambda: not f.console.viewers and not f.hub.call("watching"))  # its read loop stopped, told the hub
        events: list = []
        ended = threading.Event()
        reader = threading.Thread(target=lambda: [read_stream(
            f.url + EVENTS, {}, lambda ev: done_by_replica(ev).get("replica-a", 0) >= 1, events), ended.set()])
        reader.start()
        until(lambda: f.hub.call("watching") or ended.is_set())
        assert not ended.is_set(), f"the stream ended after {events}"
        body = {"prompt": "a four", "num_inference_steps": 3}
        assert httpx.post(f.urls["replica-a"] + "/v1/images/generations", json=body, timeout=240).status_code == 200
        reader.join()
        assert events[0][0] == "hello" and done_by_replica(events) == {"replica-a": 1} and not f.console.closed
