"""Clocks. Only the outer loops (server, offline generate, simulator) hold one; the engine core is given `now`."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep_until(self, t: float) -> None: ...

    def elapse(self, dt: float) -> None:
        """Account for `dt` seconds of work just reported by the executor (a real clock has already moved)."""
        ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep_until(self, t: float) -> None:
        delay = t - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def elapse(self, dt: float) -> None:
        pass


class SimClock:
    """Simulated time: moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time does not run backwards")
        self._t += dt

    def sleep_until(self, t: float) -> None:
        self._t = max(self._t, t)

    def elapse(self, dt: float) -> None:
        self.advance(dt)
