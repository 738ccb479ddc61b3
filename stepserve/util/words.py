"""Counts in words for what the commands print: "1 thread", "2 threads", "0.5 CPUs"."""

from __future__ import annotations


def noun_for(count: float, noun: str, many: str | None = None) -> str:
    """The noun as `count` of them take it: singular for exactly 1, else plural (`many` if irregular)."""
    return noun if count == 1 else many or noun + "s"


def plural(count: float, noun: str, many: str | None = None) -> str:
    """The count and its noun: "1 replica", "3 replicas", "0.5 CPUs"."""
    number = f"{count:g}" if isinstance(count, float) else str(count)
    return f"{number} {noun_for(count, noun, many)}"


def duration(seconds: float) -> str:
    """A span of time as people read it, to three significant digits: "10 ms", "0.4 ms", "1.26 s", "125 s"."""
    if abs(seconds) < 1:
        return f"{_significant(seconds * 1000)} ms"
    return f"{seconds:.0f} s" if abs(seconds) >= 100 else f"{_significant(seconds)} s"


def _significant(value: float) -> str:
    text = f"{value:.3g}"
    return "0" if text in ("0", "-0") else text
