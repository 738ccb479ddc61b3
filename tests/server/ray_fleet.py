"""Helpers of test_ray_jobs.py: one `stepserve serve --replicas 2` at a time on the module's Ray cluster, each on a
state store the test also opens itself, and HTTP on fresh connections (Ray's proxy picks a replica for each).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from ray_cluster import Cluster, ServeProcess
from replica_gate import Gate

from stepserve.server.app import REPLICA_HEADER

HANG_S = 240.0  # bounds a hang only: every wait below waits on the servers' or the store's own state


@dataclass
class State:
    """A state store as `serve --state` takes it, and the results folder beside it."""

    backend: str
    url: str
    results: Path

    def open(self):
        from stepserve.store import open_store

        return open_store(self.url)


class Fleet:
    """At most one `stepserve serve --replicas 2` on the cluster at a time (one Serve application, one proxy
    port): get() stops the one running when another model or state is asked for."""

    def __init__(self, cluster: Cluster, gate: Gate, models: dict[str, tuple[str, ...]], lease_s: float) -> None:
        self.cluster, self.gate, self.models, self.lease_s = cluster, gate, models, lease_s
        self.server: ServeProcess | None = None
        self.key: tuple[str, str] | None = None

    def get(self, model: str, state: State, while_booting: Callable[[], object] | None = None) -> ServeProcess:
        if self.key == (model, state.url):
            return self.server
        self.stop()
        self.gate.free()
        self.gate.forget()
        path, *flags = self.models[model]
        self.server = ServeProcess(
            self.cluster.mark, "--replicas", "2", "--ray-address", self.cluster.address, "--strategy", "continuous",
            "--max-batch-size", "4", "--max-ongoing-requests", "16", "--shutdown-grace-s", "5",
            "--state", state.url, "--results", str(state.results), "--job-lease-s", f"{self.lease_s:g}",
            "--router", "power_of_two", *flags,  # Anchors steer a request by requests in flight: Ray's own router
            model=path)
        self.key = (model, state.url)
        if while_booting is not None:
            while_booting()
        self.server.wait_ready()
        return self.server

    def stop(self) -> int | None:
        """SIGTERM to the running `serve`, if any: Ray stops its replicas (serve.delete); its exit status."""
        server, self.server, self.key = self.server, None, None
        if server is None:
            return None
        try:
            return server.stop()
        finally:
            server.log.close()


def replica(response: httpx.Response) -> str:
    return response.headers[REPLICA_HEADER]


def fresh(method: str, url: str, **kwargs) -> httpx.Response:
    """One request on a connection of its own: Ray's proxy routes each anew."""
    with httpx.Client(timeout=HANG_S) as client:
        return client.request(method, url, **kwargs)


def from_both(method: str, url: str, replicas: int = 2, tries: int = 60, **kwargs) -> dict[str, httpx.Response]:
    """The answer of each replica to the same request, sent on fresh connections until every replica answered
    (the proxy picks one at random for each: 60 tries all on one replica of two has odds 2**-59)."""
    answers: dict[str, httpx.Response] = {}
    for _ in range(tries):
        r = fresh(method, url, **kwargs)
        answers.setdefault(replica(r), r)
        if len(answers) == replicas:
            break
    return answers


class Anchors:
    """Streams held open through Ray's proxy (the job's event stream) until the chosen replica has one more in
    flight than the other. Ray's router sends a request to the replica with fewer requests in flight (of the two
    it samples: here both), so the next request goes to the other replica."""

    def __init__(self, url: str, busy: str, tries: int = 40) -> None:
        self.streams: list[tuple[httpx.Client, httpx.Response]] = []
        count = {busy: 0, "other": 0}
        for _ in range(tries):
            client = httpx.Client(timeout=HANG_S)
            response = client.send(client.build_request("GET", url), stream=True)
            assert response.status_code == 200, response.read()
            self.streams.append((client, response))
            count[busy if replica(response) == busy else "other"] += 1
            if count[busy] == count["other"] + 1:
                return
        self.close()
        raise AssertionError(f"no stream reached replica {busy} ahead of the other in {tries} tries: {count}")

    def close(self) -> None:
        for client, response in self.streams:
            response.close()
            client.close()
        self.streams = []


def wait_for(check: Callable[[], object], what: str, timeout_s: float = HANG_S):
    """check()'s first true value (timeout_s bounds a hang only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)
