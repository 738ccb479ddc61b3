"""The processes of a local Ray cluster that `stepserve serve --replicas` started (no --ray-address): made this
process's descendants even when Ray orphans them, reaped while it runs, and ended when it stops. Linux's /proc;
elsewhere nothing is found and nothing is done. No Ray here."""

from __future__ import annotations

import os
import shutil
import signal
import time


def adopt_orphans() -> None:
    """Linux: become the child subreaper, so that Ray workers orphaned by a raylet killed from outside (a signal to
    the whole process group) stay our descendants, and end_leftovers() can stop them."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def end_leftovers(wait_s: float = 5.0) -> None:
    """Stop whatever the local cluster left running below this process: SIGTERM, then SIGKILL after wait_s."""
    pids = descendants(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            reap()
            pids = [p for p in pids if os.path.exists(f"/proc/{p}")]
            time.sleep(0.1)
        if not pids:
            return


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [root]
    while frontier:
        children = [p for p, pp in parent.items() if pp in frontier]
        found += children
        frontier = children
    return found


def remove_session(session: str | None) -> None:
    """Delete the session folder of the local cluster this process started, and Ray's `session_latest` link to it
    (the logs are gone with it: keep them with --ray-address and a cluster of your own)."""
    if not session or not os.path.isdir(session):
        return
    latest = os.path.join(os.path.dirname(session), "session_latest")
    if os.path.islink(latest) and os.path.realpath(latest) == os.path.realpath(session):
        os.unlink(latest)
    shutil.rmtree(session, ignore_errors=True)
