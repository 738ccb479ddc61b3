"""Progress reporting that suits where it goes.

On a terminal, `progress()` gives a live tqdm bar. Anywhere else (a log file, CI, `make demo > log`) a bar's
carriage-return redraws would pile up as one line per update, so it gives a `LineProgress` instead: one line when
the phase starts and one when it ends. Both have the same interface: update, set_postfix, close, and use as a
context manager.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from .words import plural


def is_terminal(stream: IO | None) -> bool:
    isatty = getattr(stream, "isatty", None)
    if isatty is None:
        return False
    try:
        return bool(isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False


def progress(total: int | None = None, desc: str = "", unit: str = "item", *, disable: bool = False,
             file: IO | None = None, **bar_options: Any):
    """A progress bar for `total` units (None: unknown) written to `file` (default: stderr). `unit` is a noun in
    the singular ("image", "request"): the lines put it in the plural where the count calls for it.

    A tqdm bar when `file` is a terminal, else a LineProgress; `bar_options` (leave, dynamic_ncols, ...) only
    apply to the tqdm bar. With `disable`, nothing is written."""
    stream = sys.stderr if file is None else file
    if disable:
        return LineProgress(total, desc, unit, file=stream, enabled=False)
    if is_terminal(stream):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, **bar_options)
    return LineProgress(total, desc, unit, file=stream)


class LineProgress:
    """Counts like a tqdm bar but writes only "DESC: started (N UNITs)" and "DESC: done N UNITs in X s", where
    X s is the time since the bar started: the phase it counts, not the whole command."""

    def __init__(self, total: int | None, desc: str, unit: str = "item", file: IO | None = None,
                 enabled: bool = True) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self.file = sys.stderr if file is None else file
        self.enabled = enabled
        self.postfix = ""
        self.closed = False
        self.start_t = time.monotonic()
        self._write(f"{desc}: started" + (f" ({plural(total, unit)})" if total is not None else ""))

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        elapsed = time.monotonic() - self.start_t
        if self.total is not None and self.n < self.total:
            line = f"{self.desc}: stopped at {self.n}/{plural(self.total, self.unit)} after {elapsed:.1f} s"
        else:
            line = f"{self.desc}: done {plural(self.n, self.unit)} in {elapsed:.1f} s"
        self._write(line + (f" ({self.postfix})" if self.postfix else ""))

    def _write(self, line: str) -> None:
        if not self.enabled:
            return
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except (ValueError, OSError):  # the stream is gone; progress is never worth failing the work for
            pass

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
