"""What every plot of the bench, the simulator and the planner shares: a file-only figure, log axes whose tick
labels stay apart at any range, integer ticks for counts, distinct hollow markers per series, and titles that
say when the numbers come from the simulator.

matplotlib is imported where it is used, so that the commands importing the bench start without it."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MOST_TICKS = 6  # labelled ticks on a log axis at most; neighbours stay at least 1/6 of the axis apart
# per series: a shape, and a size that shrinks so that a later marker drawn on an earlier one stays inside it
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")
DPI = 110


def new_figure(width_in: float, height_in: float) -> Figure:
    """A figure drawn by the Agg renderer straight to files: no display, and no pyplot state to close."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in))
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: Path, dpi: int = DPI) -> Figure:
    """Lay the figure out, write it as a PNG and hand it back (tests read its axes)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return fig


def marked(title: str, simulated: bool) -> str:
    """The title, saying "Simulated" first when the numbers come from a latency model, not from a device."""
    return f"Simulated: {title}" if simulated else title


def series_style(index: int) -> dict:
    """Marker options for the index-th series: its own shape, hollow, each a little smaller than the one before,
    so that series lying on the same points all stay visible."""
    return {"marker": MARKERS[index % len(MARKERS)], "markersize": max(4.0, 9.0 - 1.2 * (index % len(MARKERS))),
            "markerfacecolor": "none", "markeredgewidth": 1.3}


def integer_ticks(axis, most: int | str = "auto") -> None:
    """Whole-number ticks only (for counts: batch sizes, replicas), 1, 2, 4, 5 or 10 times a power of ten apart;
    at most `most` intervals ("auto": as many as the axis length allows)."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(nbins=most, integer=True, steps=[1, 2, 4, 5, 10]))


def log_axis(ax, which: str, values: Iterable[float]) -> None:
    """Log scale on ax's `which` axis ("x" or "y"), limits just around `values` (the positive ones), and labelled
    ticks from log_ticks: labels read as plain numbers ("0.105", "10") and never crowd each other."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    shown = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not shown:  # nothing to show: matplotlib's own empty log axis
        return
    lo, hi = min(shown), max(shown)
    pad = max(1.02, (hi / lo) ** 0.03)  # a little room beyond the extreme points, in log terms
    lo, hi = lo / pad, hi * pad
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xlim if which == "x" else ax.set_ylim)(lo, hi)
    axis.set_major_locator(FixedLocator(log_ticks(lo, hi)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.6g}"))
    axis.set_minor_formatter(NullFormatter())  # minor ticks draw grid lines only


def log_ticks(lo: float, hi: float, most: int = MOST_TICKS) -> list[float]:
    """Round tick values between lo and hi (0 < lo < hi) for a log axis.

    The coarsest grid that gives at least three ticks: decades, then 1-2-5 in each decade, then 1 to 9. A grid's
    ticks are thinned so that neighbours are at least 1/`most` of the axis apart (on a log axis 8 and 9 lie much
    closer than 1 and 2). A range too narrow for any of them (0.10 to 0.12) gets evenly spaced round values,
    which on so short a log axis lie evenly too."""
    from matplotlib.ticker import MaxNLocator

    gap = math.log10(hi / lo) / most
    decades = range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
    for mantissas in ((1,), (1, 2, 5), range(1, 10)):
        grid = [float(f"{m}e{e}") for e in decades for m in mantissas]  # exact decimals: 3e-1, not 0.30000000004
        ticks = _spread([t for t in grid if lo <= t <= hi], gap)
        if len(ticks) >= 3:
            return ticks
    even = MaxNLocator(most - 1, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi)
    return [float(f"{t:.12g}") for t in even if lo <= t <= hi]


def _spread(ticks: list[float], gap: float) -> list[float]:
    """Ticks in increasing order, keeping each one at least `gap` decades above the last one kept."""
    kept: list[float] = []
    for t in ticks:
        if not kept or math.log10(t / kept[-1]) >= gap * 0.999:
            kept.append(t)
    return kept
