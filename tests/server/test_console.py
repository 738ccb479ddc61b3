"""The web console's server side: GET / serves the page and its files (nothing from elsewhere), and
/v1/engine/events streams one compact record per engine step to each viewer, behind the API key; with no viewer
the engine carries no per-step record callback. The Grafana dashboard names only metrics the server exports."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
from server_helpers import wait_until

from stepserve.server.events import EngineEvents

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "stepserve-dashboard.json"


def test_the_page_and_its_files_are_served_without_a_key(serve):
    with serve(strategy="continuous", api_key="secret") as server:
        page = httpx.get(server.url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/console/console.js" in page.text and "secret" not in page.text
        for name, kind in (("console.js", "javascript"), ("lanes.js", "javascript"), ("models.js", "javascript"),
                           ("console.css", "css")):
            asset = httpx.get(f"{server.url}/console/{name}")
            assert asset.status_code == 200 and kind in asset.headers["content-type"]
        assert httpx.get(server.url + "/console/../app.py").status_code == 404
        assert httpx.get(server.url + "/console/other.js").status_code == 404
        # nothing is fetched from another host: every src/href is a local path
        links = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert links and all(link.startswith("/console/") for link in links)
        for name in ("console.js", "lanes.js", "models.js", "console.css"):
            assert not re.search(r"https?://", httpx.get(f"{server.url}/console/{name}").text)


def read_events(url: str, headers: dict, until, timeout_s: float = 240.0) -> list[tuple[str, dict]]:
    events: list[tuple[str, dict]] = []
    deadline = time.monotonic() + timeout_s
    with httpx.stream("GET", url, headers=headers, timeout=timeout_s) as answer:
        assert answer.status_code == 200, answer.read()
        kind = None
        for line in answer.iter_lines():
            if line.startswith("event:"):
                kind = line[6:].strip()
            elif line.startswith("data:"):
                events.append((kind, json.loads(line[5:])))
                if until(events) or time.monotonic() > deadline:
                    break
    return events


def test_events_stream_steps_to_a_viewer_behind_the_key(serve):
    with serve(strategy="continuous", api_key="secret", max_batch_size=4) as server:
        url = server.url + "/v1/engine/events"
        assert httpx.get(url, timeout=5).status_code == 401
        hub = next(cb.__self__ for cb in server.engine.on_step if isinstance(getattr(cb, "__self__", None), EngineEvents))
        assert hub.on_step not in server.engine.on_step  # no viewer: no per-step record is built
        body = {"prompt": "a seven", "num_inference_steps": 6, "n": 3, "seed": 1}
        sender = threading.Thread(target=lambda: [wait_until(lambda: hub.viewers == 1, 240), httpx.post(
            server.url + "/v1/images/generations", json=body, headers={"Authorization": "Bearer secret"},
            timeout=240)])  # sent once the viewer is there: it sees every step
        sender.start()
        events = read_events(url, {"Authorization": "Bearer secret"},
                             lambda ev: sum(len(d["done"]) for k, b in ev if k == "steps" for d in b) >= 3)
        sender.join()
        kinds = [k for k, _ in events]
        assert kinds[0] == "hello" and events[0][1]["model"]["name"] and events[0][1]["max_batch_size"] == 4
        assert events[0][1]["model"]["negative_prompt"] is server.engine.model_info.negative_prompt  # the form's field
        assert set(kinds[1:]) == {"steps"}
        steps = [d for k, batch in events[1:] for d in batch]
        joined = {i for d in steps for i in d["joined"]}
        assert len(joined) == 3
        rows = [r for d in steps for r in d["rows"]]
        assert {r[2] for r in rows} == {6} and max(r[1] for r in rows) == 6
        assert all(set(d) == {"t", "dt", "rows", "joined", "paused", "done", "queue", "running", "cap"} for d in steps)
        done = [e for d in steps for e in d["done"]]
        assert {e[0] for e in done} == joined and all(e[1] == "completed" and e[2] > 0 for e in done)
        assert {r[0] for r in rows} == joined  # one id per request from joining to leaving
        wait_until(lambda: hub.viewers == 0, 240)  # the viewer left: the hub lets go of the engine's steps
        assert hub.viewers == 0 and hub.on_step not in server.engine.on_step
        again = read_events(url, {"Authorization": "Bearer secret"}, lambda ev: True)
        assert [r[0] for r in again[0][1]["recent"]][-3:] == ["completed"] * 3  # remembered for the next viewer


def test_the_dashboard_names_only_exported_metrics(serve):
    with serve(strategy="slo") as server:
        httpx.post(server.url + "/v1/images/generations", json={"prompt": "a seven", "num_inference_steps": 2},
                   timeout=60)
        exported = {line.split("{")[0].split(" ")[0] for line in httpx.get(server.url + "/metrics").text.splitlines()
                    if line and not line.startswith("#")}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"stepserve_[a-z_]+", e)}
    assert named and named <= exported, named - exported
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("outcome", "latency", "queue", "batch", "step time", "refusals", "deadline"):
        assert topic in titles


def test_draining_ends_the_event_streams(serve):
    """An events stream never ends by itself; when the server starts draining it must, or it would hold the
    graceful shutdown for its whole timeout."""
    from stepserve.server.app import start_drain

    with serve(strategy="continuous") as server:
        hub = server.app.state.server.events
        ended = threading.Event()

        def viewer():
            with httpx.stream("GET", server.url + "/v1/engine/events", timeout=30) as answer:
                for _ in answer.iter_lines():
                    pass
            ended.set()

        threading.Thread(target=viewer, daemon=True).start()
        wait_until(lambda: hub.viewers > 0, 240)
        assert hub.viewers == 1 and not ended.is_set()
        start_drain(server.app)
        assert ended.wait(240)
        late = read_events(server.url + "/v1/engine/events", {}, lambda ev: False)
        assert [k for k, _ in late] == ["hello"]  # a viewer arriving while draining gets its hello, then the end


def test_the_console_stream_is_framed_by_the_one_sse_function():
    """Image streams and the console's stream share one SSE framing (streaming.sse): same bytes for the same
    event, compact JSON, one blank line after each event."""
    import asyncio
    from types import SimpleNamespace

    from stepserve.server.streaming import sse

    engine = SimpleNamespace(on_step=[])
    hub = EngineEvents(engine)
    hello = {"model": {"name": "tiny", "sizes": [256, 512]}, "max_batch_size": 4, "recent": [], "t": 1.5}
    hub.hello = lambda: hello
    batch = '[{"t":0.1,"rows":[[1,2,20]]}]'

    async def first_two():
        queue = hub.subscribe()
        hub._pending = [batch[1:-1]]  # one record built in the engine thread, flushed to the viewers as a batch
        hub._flush()
        stream = hub.chunks(queue)
        chunks = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return chunks

    chunks = asyncio.run(first_two())
    assert chunks == [sse("hello", hello), sse("steps", batch)]
    assert chunks[0] == b'event: hello\ndata: {"model":{"name":"tiny","sizes":[256,512]},"max_batch_size":4,' \
                        b'"recent":[],"t":1.5}\n\n'


def test_at_most_16_viewers_the_next_gets_a_429_and_a_closed_stream_frees_its_place(serve):
    """Every stream holds a connection for as long as its tab is open: one server feeds at most MAX_VIEWERS; the
    next is refused at once in the OpenAI shape with Retry-After, and a viewer that leaves frees its place."""
    import asyncio
    import contextlib

    from server_helpers import assert_error_shape

    from stepserve.server.viewers import MAX_VIEWERS

    assert MAX_VIEWERS == 16
    with serve(strategy="continuous", api_key="secret") as server:
        hub = server.app.state.server.events
        url = server.url + "/v1/engine/events"

        async def viewers():
            limits = httpx.Limits(max_connections=MAX_VIEWERS + 4)
            async with httpx.AsyncClient(timeout=240, limits=limits,
                                         headers={"Authorization": "Bearer secret"}) as client, \
                    contextlib.AsyncExitStack() as stack:
                streams = [await stack.enter_async_context(client.stream("GET", url)) for _ in range(MAX_VIEWERS)]
                assert [s.status_code for s in streams] == [200] * MAX_VIEWERS and hub.viewers == MAX_VIEWERS
                async with client.stream("GET", url) as refused:  # a stream: the check cannot hang on one
                    assert refused.status_code == 429
                    await refused.aread()
                error = assert_error_shape(refused, 429)
                assert error["code"] == "too_many_viewers" and "16 viewers" in error["message"]
                assert refused.headers["Retry-After"] == "10" and hub.viewers == MAX_VIEWERS
                await streams[0].aclose()  # one tab closes
                while hub.viewers != MAX_VIEWERS - 1:  # the server sees it go (bounded by the test timeout)
                    await asyncio.sleep(0.02)
                async with client.stream("GET", url) as again:
                    assert again.status_code == 200
                    assert (await again.aiter_lines().__anext__()) == "event: hello"

        asyncio.run(viewers())
        wait_until(lambda: hub.viewers == 0, 240)
        assert hub.viewers == 0
