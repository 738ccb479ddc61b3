"""Serving with uvicorn so that the first SIGTERM/SIGINT drains: no new image requests (503), the ones in flight
finish within the grace period, whatever is left is aborted (503), then the process exits 0. A second signal stops
at once."""

from __future__ import annotations

import asyncio
import signal
import time

import uvicorn


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM/SIGINT drains instead of closing the door on requests in flight."""

    def __init__(self, config: uvicorn.Config, app, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:  # runs as a signal handler in the loop's thread
        if self.draining or self.loop is None:  # a second signal: stop now
            self.should_exit = True
            self.force_exit = self.draining and sig == signal.SIGINT
            return
        self.draining = True
        self.loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        assert self.loop is not None
        self.drain_task = self.loop.create_task(drain(self.app, self, self.grace_s))


async def drain(app, server, grace_s: float) -> None:
    """Refuse new work, wait for the work in flight (at most grace_s), abort the rest, then let uvicorn exit."""
    from .app import is_idle, start_drain

    if hasattr(app, "start_drain"):  # a server of several models (dispatch.py): no model loads any more
        app.start_drain()
    apps = app.apps() if hasattr(app, "apps") else [app]  # each model's app, or the one
    for one in apps:
        start_drain(one)
    deadline = time.monotonic() + grace_s
    while not all(is_idle(one) for one in apps) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for one in apps:
        if not is_idle(one):
            await one.state.server.engine.shutdown(0.0)  # the requests left get 503
    settle = time.monotonic() + 2.0
    while any(one.state.server.inflight for one in apps) and time.monotonic() < settle:
        await asyncio.sleep(0.02)
    server.should_exit = True
