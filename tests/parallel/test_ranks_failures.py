"""A split model's failures over HTTP: a worker killed mid-step makes /health 503 and answers what was in flight
with an error, and no process outlives the server (SIGTERM, or rank 0 killed)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from rank_servers import HANG_S, RankServer, tiny_flux, wait_gone

pytestmark = pytest.mark.slow  # each test starts a server of two ranks
GENERATIONS = "/v1/images/generations"
LONG = {"prompt": "a long one", "size": "64x64", "num_inference_steps": 200}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tiny_flux(tmp_path_factory)


class Stream:
    """A streamed request of LONG in a thread: `stepping` is set at its first partial image (the model is then
    denoising, every rank inside its steps); `events` holds the event names it got."""

    def __init__(self, url: str, steps: int = LONG["num_inference_steps"]) -> None:
        self.steps = steps
        self.stepping = threading.Event()
        self.events: list[tuple[str, dict]] = []
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()

    def _run(self, url: str) -> None:
        body = {**LONG, "num_inference_steps": self.steps, "stream": True, "partial_images": 3}
        try:
            with httpx.stream("POST", url + GENERATIONS, json=body, timeout=HANG_S) as r:
                name = None
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        self.events.append((name, json.loads(line[6:])))
                        if name == "image_generation.partial_image":
                            self.stepping.set()
                if r.status_code != 200:
                    self.events.append(("status", {"status": r.status_code, "body": r.read().decode()}))
        except httpx.TransportError as exc:  # the server went (rank 0 killed)
            self.events.append(("closed", {"error": str(exc)}))
        self.stepping.set()


def test_a_worker_killed_mid_step_turns_health_503_fails_what_is_in_flight_and_leaves_no_process(flux):
    server = RankServer(flux, "--ulysses-degree", "2").start()
    try:
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        (worker,) = server.workers()
        plain: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: plain.append(
            httpx.post(server.url + GENERATIONS, json={**LONG, "seed": 2}, timeout=HANG_S)), daemon=True)
        waiting.start()
        stream = Stream(server.url)
        assert stream.stepping.wait(HANG_S) and not stream.events[-1][0].endswith("completed"), stream.events
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        while (health := httpx.get(server.url + "/health")).status_code != 503:
            assert time.monotonic() - killed < HANG_S, health.text
        unhealthy_s = time.monotonic() - killed
        assert health.json()["reason"] == "engine_failed" and health.json()["running"] == 0
        waiting.join(HANG_S)
        stream.thread.join(HANG_S)
        answered_s = time.monotonic() - killed
        error = plain[0].json()["error"]
        assert plain[0].status_code == 500 and error["code"] == "model_failure", plain[0].text
        # the client hears what happened; which rank, its pid and why are in the server's log only
        assert "a rank of this model failed" in error["message"] and str(worker) not in error["message"], error
        assert stream.events[-1][0] == "error" and "a rank of this model failed" in json.dumps(stream.events[-1][1])
        assert str(worker) not in json.dumps(stream.events[-1][1])
        assert server.wait_for(f"worker rank 1 (pid {worker}) was killed by signal 9"), "".join(server.lines[-20:])
        assert server.wait_for("the engine thread stopped: worker rank 1"), "".join(server.lines[-20:])  # not stuck
        refused = httpx.post(server.url + GENERATIONS, json={"prompt": "after"}, timeout=HANG_S)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_failed"
        print(f"worker killed mid-step: /health 503 after {unhealthy_s:.3f} s, both requests answered after "
              f"{answered_s:.3f} s")
        stopping = time.monotonic()
        assert server.stop(signal.SIGTERM) == 0, "".join(server.lines[-20:])
        print(f"SIGTERM after the failure: exited after {time.monotonic() - stopping:.3f} s")
        assert wait_gone([worker])
        assert "Traceback" not in "".join(server.lines), "".join(server.lines)  # one line says why, not a trace
    finally:
        server.stop(signal.SIGKILL)


def test_rank_0_killed_mid_step_leaves_no_worker(flux):
    server = RankServer(flux, "--ulysses-degree", "2").start()
    try:
        workers = server.workers()
        stream = Stream(server.url)
        assert stream.stepping.wait(HANG_S)
        server.proc.kill()
        assert wait_gone(workers), workers
    finally:
        server.stop(signal.SIGKILL)


def test_sigterm_to_the_whole_process_group_drains_through_rank_0(flux):
    """A service manager's stop (or Ctrl-C in a terminal) signals every process of the group: the workers leave
    their ending to rank 0, which finishes the request in flight, then stops them."""
    server = RankServer(flux, "--ulysses-degree", "2", new_session=True).start()
    try:
        workers = server.workers()
        stream = Stream(server.url, steps=40)
        assert stream.stepping.wait(HANG_S)
        os.killpg(server.proc.pid, signal.SIGTERM)
        stream.thread.join(HANG_S)
        assert stream.events[-1][0] == "image_generation.completed", stream.events[-1]
        assert server.stop(signal.SIGTERM) == 0, "".join(server.lines[-20:])
        assert wait_gone(workers), workers
        assert "worker rank" not in "".join(server.lines), "".join(server.lines[-20:])  # no rank died on its own
    finally:
        server.stop(signal.SIGKILL)
