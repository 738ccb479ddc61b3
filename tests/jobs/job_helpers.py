"""Helpers of the jobs tests: an app over a store of the test's choosing (the routes and the runner of one process;
two of them on one store stand for two replicas), waiting for a job's end, a store that counts its calls, a webhook
sender that records what it was asked to send; and fixtures (import them by name: this folder has no conftest.py,
whose module name the server tests import): a tiny random Wan folder, one torch thread."""

from __future__ import annotations

import time

import pytest

from fastapi.testclient import TestClient

from stepserve.engine.async_engine import AsyncEngine
from stepserve.server.app import create_app


def app_client(executor, store=None, results=None, owner=None, poll_s=0.05, lease_s=30.0, limits=None,
               shutdown_grace_s=5.0, webhook_secret=None, service=None, max_attempts=3, webhook_allow=(),
               **options) -> TestClient:
    options = {"strategy": "continuous", "max_batch_size": 4, **options}
    return TestClient(create_app(AsyncEngine(executor, **options), limits=limits, store=store, results=results,
                                 owner=owner, job_poll_s=poll_s, job_lease_s=lease_s,
                                 shutdown_grace_s=shutdown_grace_s, webhook_secret=webhook_secret, service=service,
                                 job_max_attempts=max_attempts, webhook_allow=webhook_allow))


def die(runner) -> None:
    """Stop a job runner at once without a word to the store, as a process that is killed does: its jobs keep
    their owner until their leases pass, then another process takes them."""
    runner.claiming, runner._closing = False, True
    for task in [runner._loop_task, *(r.task for r in runner.running.values())]:
        if task is not None:
            task.cancel()


def wait_job(c: TestClient, path: str, timeout_s: float = 240, headers=None) -> dict:
    """The job at `path` once it has finished (after `timeout_s`, which bounds a hang only: as it is then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = c.get(path, headers=headers).json()
        if body.get("status") in ("completed", "failed") or time.monotonic() > deadline:
            return body
        time.sleep(0.02)


class CountingStore:
    """A store (wrapping another) that counts every call made to it."""

    def __init__(self, store) -> None:
        self._store = store
        self.calls: list[str] = []
        self.url = store.url

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args, **kwargs):
            self.calls.append(name)
            return attr(*args, **kwargs)

        return counted


class RecordingSender:
    """Stands in for the webhook sender (stepserve/jobs/webhooks.py): records each deliver() call."""

    def __init__(self) -> None:
        self.delivered: list[tuple] = []

    async def deliver(self, job, payload, owner) -> None:
        self.delivered.append((job, payload, owner))


@pytest.fixture(scope="session")
def wan_folder(tmp_path_factory):
    """A tiny random Wan pipeline folder (video jobs), built once per session."""
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan_jobs") / "pipe")


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread: a test runs two engines (two processes' worth) on the machine's cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
