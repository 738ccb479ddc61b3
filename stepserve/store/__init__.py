"""The state store (base.py: the interface), chosen by URL: `memory`, `sqlite:///PATH` (the default: a file under
the user's state directory) or `redis://HOST:PORT/DB`. `serve --state URL`, or the environment variable
STEPSERVE_STATE. No torch."""

from __future__ import annotations

import os
from pathlib import Path

from ..util.urls import without_password
from .base import (COMPLETED, FAILED, FINISHED, IN_PROGRESS, KINDS, QUEUED, AdapterRecord, JobRecord,  # noqa: F401
                   Store, StoreError)

STATE_ENV = "STEPSERVE_STATE"
SCHEMES = "memory, sqlite:///PATH or redis://HOST:PORT/DB"


def state_dir(environ=os.environ) -> Path:
    """$XDG_STATE_HOME/stepserve, else ~/.local/state/stepserve (the XDG base directory default)."""
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "stepserve"


def default_url(environ=os.environ) -> str:
    """STEPSERVE_STATE when set, else a SQLite file in the user's state directory."""
    return environ.get(STATE_ENV) or f"sqlite:///{state_dir(environ) / 'state.db'}"


def absolute_url(url: str) -> str:
    """A sqlite:///PATH with PATH made absolute (from this process's working folder, once, at start-up: every
    process and replica then opens the same file); any other URL as it is."""
    if url.startswith("sqlite:///") and url[len("sqlite:///"):]:
        return f"sqlite:///{os.path.abspath(url[len('sqlite:///'):])}"
    return url


def sqlite_path(url: str) -> Path | None:
    """The file a sqlite:/// URL names; None for any other URL."""
    return Path(url[len("sqlite:///"):]) if url.startswith("sqlite:///") else None


def open_store(url: str) -> Store:
    """The store a URL names. ValueError (saying what is allowed) for any other URL."""
    if url == "memory":
        from .memory import MemoryStore

        return MemoryStore()
    if url.startswith("sqlite:///"):
        from .sqlite import SqliteStore

        return SqliteStore(url[len("sqlite:///"):])
    if url.startswith(("redis://", "rediss://")):
        from .redis import RedisStore

        return RedisStore(url)
    raise ValueError(f"state {without_password(url)!r}: allowed: {SCHEMES}")
