"""SIGTERM handled like Ctrl-C by the long-running commands (`stepserve bench`, `stepserve demo`, the Triton
launcher): `kill PID`, `docker stop` and systemd send SIGTERM, and the command must then clean up (peer servers,
tritonserver and its stubs, temporary folders) exactly as it does on Ctrl-C. `stepserve serve` drains on SIGTERM
its own way (server/draining.py)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C or SIGTERM (128 + SIGINT, as shells report)


def _as_sigint(signum, frame) -> None:
    handler = signal.getsignal(signal.SIGINT)  # asyncio.run's (cancels its task) or Python's (KeyboardInterrupt)
    if not callable(handler):  # SIGINT ignored or default, e.g. in a job started in the background by a shell
        handler = signal.default_int_handler
    handler(signal.SIGINT, frame)


def handle_sigterm_as_ctrl_c():
    """From now on SIGTERM does what SIGINT does when it arrives. Returns the earlier handler (None outside the
    main thread, where signals cannot be handled and nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _as_sigint)


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Within the block, SIGTERM does what SIGINT does; the earlier handler is restored after."""
    previous = handle_sigterm_as_ctrl_c()
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
