"""`stepserve plan`'s plot: p95 latency against replica count, one series per strategy, the SLO as a line."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.transforms import offset_copy

from ..bench.plot_axes import (
    integer_ticks,
    log_axis,
    marked,
    new_figure,
    save,
    series_style,
)
from .plan import PlanSpec, StrategyPlan

OFFSET_PT = 2.0  # sideways shift between neighbouring strategies' markers, in points (a small part of a marker)


def plot_p95_vs_replicas(spec: PlanSpec, plans: list[StrategyPlan], path: Path) -> Figure:
    """p95 on a log axis, so that 50 ms and 10 s both read. Counts whose p95 is infinite or unknown (the run
    stopped early) are crosses at the top. Strategies often share points (the same count, nearly the same p95):
    each has its own hollow marker shape and size and is shifted a few points sideways, so that none hides
    another."""
    fig = new_figure(7, 4.5)
    ax = fig.subplots()
    slo_ms = spec.slo_s * 1000
    finite = [p.p95_s * 1000 for pl in plans for p in pl.probes if math.isfinite(p.p95_s) and not p.stopped_early]
    top = max([slo_ms, *finite]) * 1.5  # where the crosses go, above every finite p95
    off_chart = False
    for i, pl in enumerate(plans):
        ok = [p for p in pl.probes if math.isfinite(p.p95_s) and not p.stopped_early]
        bad = [p for p in pl.probes if p not in ok]
        shifted = offset_copy(ax.transData, fig=fig, x=(i - (len(plans) - 1) / 2) * OFFSET_PT, units="points")
        label = pl.strategy + (f" (needs {pl.replicas})" if pl.replicas else f" (> {spec.max_replicas})")
        line, = ax.plot([p.replicas for p in ok], [p.p95_s * 1000 for p in ok], label=label, transform=shifted,
                        **series_style(i))
        if bad:
            off_chart = True
            ax.plot([p.replicas for p in bad], [top] * len(bad), marker="x", linestyle="none",
                    color=line.get_color(), transform=shifted)
    if off_chart:
        ax.plot([], [], marker="x", linestyle="none", color="grey", label="missed, p95 off the chart")
    ax.axhline(slo_ms, color="grey", linestyle="--", linewidth=1, label=f"SLO p95 {slo_ms:g} ms")
    # set by hand: matplotlib's autoscaling skips lines drawn through a shifted transform
    counts = [p.replicas for pl in plans for p in pl.probes] or [1]
    room = max(0.5, 0.04 * (max(counts) - min(counts)))
    ax.set_xlim(min(counts) - room, max(counts) + room)
    log_axis(ax, "y", [*finite, slo_ms] + ([top] if off_chart else []))
    integer_ticks(ax.xaxis)
    ax.set_xlabel("replicas")
    ax.set_ylabel("p95 latency (ms, log scale)")
    ax.set_title(marked(f"{spec.rate_rps:g} req/s, router {spec.router}", simulated=True), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path, dpi=120)
