"""How the report writes numbers and tables (shared by its sections)."""

from __future__ import annotations

from .repeats import Spread


def fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "n/a"
    if kind == "time":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    if kind == "rate":
        return f"{value:.2f}/s"
    if kind == "share":
        return f"{value * 100:.1f}%"
    if kind == "x":
        return f"{value:.2f}"
    return f"{value:.3g}"


def fmt_spread(s: Spread, kind: str, repeats: int) -> str:
    if s.median is None:
        return "n/a"
    if repeats < 2:
        return fmt(s.median, kind)
    return f"{fmt(s.median, kind)} [{fmt(s.low, kind)}-{fmt(s.high, kind)}]"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f} ms" if value < 10 else f"{value:.0f} ms"


def plain(line: str) -> str:
    """A report line for the terminal: its markdown marks (bold, code) taken out; report.md keeps them."""
    return line.replace("**", "").replace("`", "")
