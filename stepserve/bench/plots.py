"""Plots: latency CDF per contender, throughput vs latency from a sweep, batch size over time.

Each function writes its PNG and returns the figure (tests read its axes). `simulated` marks the title when the
results come from the simulator (BenchResults.simulated)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from .plot_axes import integer_ticks, log_axis, marked, new_figure, save, series_style
from .results import BatchTimeline, CdfSeries, SweepPoint

if TYPE_CHECKING:
    from matplotlib.figure import Figure

LATENCY_CDF = "latency_cdf.png"
THROUGHPUT_VS_LATENCY = "throughput_vs_latency.png"
BATCH_SIZE_OVER_TIME = "batch_size_over_time.png"
# Between two engine steps the engine counts as idle (no line drawn) when the gap is longer than this, or than a
# 500th of the run (about a pixel): shorter gaps are the engine's own bookkeeping between steps.
IDLE_GAP_S = 0.001


def plot_latency_cdf(series: list[CdfSeries], slo_s: float | None, path: Path, title: str = "",
                     simulated: bool = False) -> Figure:
    fig = new_figure(7, 4.5)
    ax = fig.subplots()
    for s in series:
        n = len(s.latencies_s)
        if n:
            ax.step(s.latencies_s, [(i + 1) / n for i in range(n)], where="post", label=f"{s.contender} (n={n})")
        else:
            ax.plot([], [], label=f"{s.contender} (no completed requests)")
    if slo_s:
        ax.axvline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_s * 1000:.0f} ms")
    log_axis(ax, "x", [v for s in series for v in s.latencies_s] + [slo_s])
    ax.set_xlabel("latency from scheduled send (s, log scale)")
    ax.set_ylabel("share of completed requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(textwrap.fill(marked(title or "Latency CDF", simulated), 80), fontsize=9)
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_throughput_vs_latency(points: list[SweepPoint], slo_s: float | None, path: Path,
                               simulated: bool = False) -> Figure:
    fig = new_figure(7, 4.5)
    ax = fig.subplots()
    names = list(dict.fromkeys(p.contender for p in points))
    for i, name in enumerate(names):
        mine = sorted((p for p in points if p.contender == name and p.p95_s is not None), key=lambda p: p.rate_rps)
        ax.plot([p.throughput_rps for p in mine], [p.p95_s for p in mine], label=name, **series_style(i))
    if slo_s:
        ax.axhline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_s * 1000:.0f} ms")
    log_axis(ax, "y", [p.p95_s for p in points] + [slo_s])
    ax.set_xlabel("throughput (completed images/s)")
    ax.set_ylabel("p95 latency (s, log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(marked("Throughput vs p95 latency (rate sweep, open loop)", simulated))
    ax.legend(fontsize=8)
    return save(fig, path)


def plot_batch_sizes(timelines: list[BatchTimeline], path: Path, simulated: bool = False) -> Figure | None:
    """One panel per contender on one shared time axis and one shared batch-size axis: each engine step is a
    flat segment at its batch size for as long as it ran, and the line breaks while the engine is idle. None
    (and no file) when no timeline has a step."""
    shown = [t for t in timelines if t.t_s]
    if not shown:
        return None
    fig = new_figure(7, 1.7 * len(shown) + 0.9)
    axes = fig.subplots(len(shown), 1, sharex=True, sharey=True, squeeze=False)[:, 0]
    span = max(t.t_s[-1] + t.duration_s[-1] for t in shown) - min(t.t_s[0] for t in shown)
    idle_gap = max(IDLE_GAP_S, span / 500)
    for ax, t in zip(axes, shown):
        ax.plot(*busy_steps(t, idle_gap), linewidth=0.9)
        ax.set_title(t.contender, fontsize=8, loc="left")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylim(0, max(max(t.batch_size) for t in shown) + 0.5)  # shared: every panel on one scale
    integer_ticks(axes[0].yaxis, most=4)  # shared too: a panel is short, 5 labels at most
    fig.supylabel("batch size", fontsize=9)
    axes[-1].set_xlabel("time since the start of the run (s)")
    fig.suptitle(marked("Batch size of each engine step", simulated)
                 + "\n(gaps: engine idle; 0: a step with no denoising forward, e.g. decode only)", fontsize=10)
    return save(fig, path)


def busy_steps(t: BatchTimeline, idle_gap: float) -> tuple[list[float], list[float]]:
    """x, y of a timeline's step line: each step flat from its start to its end, joined to the next step by a
    vertical riser, or broken (NaN) when the engine sat idle for longer than `idle_gap` before the next one."""
    xs: list[float] = []
    ys: list[float] = []
    for i, (start, size, took) in enumerate(zip(t.t_s, t.batch_size, t.duration_s)):
        if i and start - (t.t_s[i - 1] + t.duration_s[i - 1]) > idle_gap:
            xs.append(math.nan)
            ys.append(math.nan)
        xs += [start, start + took]
        ys += [size, size]
    return xs, ys
