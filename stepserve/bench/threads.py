"""How many torch threads an in-process bench gives the engine."""

from __future__ import annotations

import os


def default_threads() -> int:
    """In process, the engine's torch threads leave one core to the load generator, so that sends stay on time
    (and torch's threads do not wait on a core the sender holds)."""
    return max(1, (os.cpu_count() or 1) - 1)
