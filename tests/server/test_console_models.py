"""The console on a server of several models (server/dispatch.py): the front serves the page itself, so opening it
loads no model; each loaded model's steps stream at /v1/engine/events?model=NAME, named by the model and on one
time line per device, so the page can show which model held the device at each step; an open stream does not
hold its model (an idle model stays free to move off the device) and never loads one that is on disk."""

from __future__ import annotations

import json
import threading

import httpx
from server_helpers import assert_error_shape, wait_until
from two_models import two_models

EVENTS = "/v1/engine/events"


def test_the_front_serves_the_page_and_loads_no_model_for_it():
    with two_models({"a": "embedded", "b": "embedded"}, eager=()) as (server, models):
        page = httpx.get(server.url + "/", timeout=60)
        assert page.status_code == 200 and "/console/console.js" in page.text
        for name in ("console.js", "lanes.js", "models.js", "console.css"):
            assert httpx.get(f"{server.url}/console/{name}", timeout=60).status_code == 200
        assert httpx.get(server.url + "/console/other.js", timeout=60).status_code == 404
        refused = httpx.get(server.url + EVENTS + "?model=b", timeout=60)  # on disk: not loaded for a viewer
        error = assert_error_shape(refused, 409)
        assert error["code"] == "model_not_loaded" and "model b is not loaded" in error["message"]
        unknown = assert_error_shape(httpx.get(server.url + EVENTS + "?model=zz", timeout=60), 404)
        assert unknown["code"] == "model_not_found" and "a, b" in unknown["message"]
        assert [e.stack for e in models.entries.values()] == [None, None]  # neither model loaded


def read_steps(url: str, out: list, until) -> None:
    """Read a console stream into `out` as (event, data) until `until(out)`."""
    with httpx.stream("GET", url, timeout=240) as answer:
        assert answer.status_code == 200
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                out.append((kind, json.loads(line[5:])))
                if until(out):
                    return


def test_models_on_one_device_count_their_steps_from_one_origin():
    """Models load at different times (b here much later than a): their records' `t` still share one origin."""
    from types import SimpleNamespace

    from stepserve.server.events import EngineEvents

    device, other = object.__new__(type("Device", (), {})), object.__new__(type("Device", (), {}))
    a = EngineEvents(SimpleNamespace(on_step=[], device=device, device_name="a"))
    alone = EngineEvents(SimpleNamespace(on_step=[]))
    b = EngineEvents(SimpleNamespace(on_step=[], device=device, device_name="b"))
    c = EngineEvents(SimpleNamespace(on_step=[], device=other, device_name="c"))
    assert a.started == b.started and (a.model, b.model, alone.model) == ("a", "b", None)
    assert alone.started > a.started and c.started > alone.started  # a lone engine, another device: their own


def test_each_model_streams_its_steps_on_one_time_line_and_is_not_held_by_its_viewers():
    with two_models({"a": "embedded", "b": "embedded"}, eager=("a",)) as (server, models):
        body = {"prompt": "a seven", "n": 2, "num_inference_steps": 6, "seed": 3}
        first = httpx.post(server.url + "/v1/images/generations", json={**body, "model": "b"}, timeout=240)
        assert first.status_code == 200  # b loaded on its first request, well after a
        seen = {"a": [], "b": []}

        def finished(events):
            return sum(len(r["done"]) for kind, batch in events if kind == "steps" for r in batch) >= 2

        readers = [threading.Thread(target=read_steps, args=(f"{server.url}{EVENTS}?model={name}", seen[name],
                                                             finished), daemon=True) for name in seen]
        for t in readers:
            t.start()
        hubs = {name: e.app.state.server.events for name, e in models.entries.items()}
        assert wait_until(lambda: all(h.viewers == 1 for h in hubs.values()), 240)
        assert [e.pending for e in models.entries.values()] == [0, 0]  # a viewer does not pin its model
        assert not any(models._busy(e) for e in models.entries.values())  # so an idle one may still move out
        senders = [threading.Thread(target=httpx.post, args=(server.url + "/v1/images/generations",),
                                    kwargs={"json": {**body, "model": name}, "timeout": 240}) for name in seen]
        device = models.device
        with device._exclusive():  # the device held until both models bid: their steps then share it
            for t in senders:
                t.start()
            assert wait_until(lambda: len(device._bids) == 2, 240)
        for t in senders + readers:
            t.join(240)
        spans = []
        for name, events in seen.items():
            assert events[0][0] == "hello" and events[0][1]["model"]["name"] == name  # the name requests use
            steps = [r for kind, batch in events[1:] for r in batch]
            assert steps and all(r["model"] == name for r in steps)
            assert {row[2] for r in steps for row in r["rows"]} == {6}
            spans += [(r["t"], r["t"] + r["dt"], name) for r in steps if r["dt"] > 0]
        spans.sort()
        # one device, one step at a time: on the common time line no two steps overlap (t and dt are rounded), and
        # the device went from one model to the other (in the order the device policy chose: a model back from an
        # idle spell may run its short request whole, scheduling/device_share.py)
        assert all(later[0] >= earlier[1] - 2e-4 for earlier, later in zip(spans, spans[1:])), spans
        switches = sum(x[2] != y[2] for x, y in zip(spans, spans[1:]))
        assert switches >= 1 and {s[2] for s in spans} == {"a", "b"}, "".join(s[2] for s in spans)
