"""Plots: latency CDF per contender, throughput vs latency from a sweep, batch size over time."""

from __future__ import annotations

from pathlib import Path

from .results import BatchTimeline, CdfSeries, SweepPoint

LATENCY_CDF = "latency_cdf.png"
THROUGHPUT_VS_LATENCY = "throughput_vs_latency.png"
BATCH_SIZE_OVER_TIME = "batch_size_over_time.png"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdf(series: list[CdfSeries], slo_s: float | None, path: Path, title: str = "") -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in series:
        n = len(s.latencies_s)
        if n:
            ax.step(s.latencies_s, [(i + 1) / n for i in range(n)], where="post", label=f"{s.contender} (n={n})")
        else:
            ax.plot([], [], label=f"{s.contender} (no completed requests)")
    if slo_s:
        ax.axvline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_s * 1000:.0f} ms")
    ax.set_xscale("log")
    ax.set_xlabel("latency from scheduled send (s, log scale)")
    ax.set_ylabel("share of completed requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    import textwrap

    ax.set_title(textwrap.fill(title or "Latency CDF", 80), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_throughput_vs_latency(points: list[SweepPoint], slo_s: float | None, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(dict.fromkeys(p.contender for p in points))
    for name in names:
        mine = sorted((p for p in points if p.contender == name), key=lambda p: p.rate_rps)
        xs = [p.throughput_rps for p in mine if p.p95_s is not None]
        ys = [p.p95_s for p in mine if p.p95_s is not None]
        ax.plot(xs, ys, marker="o", label=name)
    if slo_s:
        ax.axhline(slo_s, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo_s * 1000:.0f} ms")
    ax.set_yscale("log")
    ax.set_xlabel("throughput (completed images/s)")
    ax.set_ylabel("p95 latency (s, log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Throughput vs p95 latency (rate sweep, open loop)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_batch_sizes(timelines: list[BatchTimeline], path: Path) -> None:
    plt = pyplot()
    shown = [t for t in timelines if t.t_s]
    if not shown:
        return
    fig, axes = plt.subplots(len(shown), 1, figsize=(7, 1.6 * len(shown) + 0.6), sharex=True, squeeze=False)
    for ax, t in zip(axes[:, 0], shown):
        ax.step(t.t_s, t.batch_size, where="post", linewidth=0.8)
        ax.set_ylabel(t.contender, fontsize=8, rotation=0, ha="right")
        ax.set_ylim(0, max(t.batch_size) + 1)
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("time since the start of the run (s)")
    fig.suptitle("Batch size of each forward pass")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
