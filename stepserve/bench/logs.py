"""What a benchmark run could not measure is logged, once per kind of failure rather than once per sample."""

from __future__ import annotations

import logging

_said: set[tuple[str, str, type]] = set()


def warn_once(log: logging.Logger, what: str, exc: BaseException, level: int = logging.WARNING) -> None:
    """Log `what` (what was skipped and what that leaves out) with the exception, the first time this logger sees
    this kind of exception for it; later ones of the same kind are only logged at DEBUG."""
    key = (log.name, what, type(exc))
    first = key not in _said
    _said.add(key)
    log.log(level if first else logging.DEBUG, "%s (%s: %s)%s", what, type(exc).__name__, exc,
            "; further failures of this kind are logged at DEBUG" if first else "")
