"""An executor whose denoising steps run only when the test lets them: what is in flight, and for how long, is then
decided by the test and not by how fast (or how busy) the machine is."""

from __future__ import annotations

import threading
from typing import Any


class SteppedExecutor:
    """Wraps an executor (every attribute is the wrapped one's) and holds each denoising step until the test allows
    it: `allow(n)` lets n more steps run, `free()` lets every step run from then on. `held` counts the steps that
    are waiting now (0 or 1: the engine runs one step at a time), `held_requests` the requests in them."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor
        self._cond = threading.Condition()
        self._permits = 0
        self._free = False
        self.held = 0
        self.held_requests = 0
        self.steps = 0  # denoising steps run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)

    def allow(self, n: int = 1) -> None:
        with self._cond:
            self._permits += n
            self._cond.notify_all()

    def free(self) -> None:
        with self._cond:
            self._free = True
            self._cond.notify_all()

    def denoise(self, requests):
        with self._cond:
            self.held += 1
            self.held_requests += len(requests)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._free or self._permits > 0)
            self.held -= 1
            self.held_requests -= len(requests)
            if not self._free:
                self._permits -= 1
        seconds = self._executor.denoise(requests)
        with self._cond:
            self.steps += 1
            self._cond.notify_all()
        return seconds

    def wait_held(self, timeout_s: float = 240.0) -> bool:
        """Wait until a step is held at the gate (a request is running and cannot move on)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.held > 0, timeout_s)
