"""What a simulated fleet did (`stepserve simulate --replicas N`), in the report and as a plot: per contender the
replicas, router, replica-seconds, lost replicas and adapter loads; and each replica's predicted work in hand
over time (replica_load.png: one row per replica, darker = more seconds of work), with the replicas paid for.

Reads each run's `fleet` (sim.fleet_run.FleetReport, or the same fields from results.json) as plain data."""

from __future__ import annotations

from pathlib import Path

from .report_format import fmt

REPLICA_LOAD = "replica_load.png"


def fleet_lines(runs: list) -> list[str]:
    """The report's "Fleet" section (empty without fleets): one row per contender, its first repeat."""
    rows = [r for r in runs if getattr(r, "fleet", None) is not None and r.repeat == 0]
    if not rows:
        return []
    lines = ["## Fleet (simulated replicas)", "",
             "| contender | replicas | router | autoscale | replica-seconds | most replicas | lost replicas "
             "(requests failed) | adapter loads |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r.fleet
        most = max((n for _, n in f.replicas_over_time), default=f.replicas)
        lost = ", ".join(map(str, f.lost_replicas)) or "none"
        lines.append(f"| {r.contender} | {f.replicas} | {f.router} | {f.autoscale or 'no'} | {f.replica_s:.0f} | "
                     f"{most} | {lost} ({f.failed_on_lost}) | {f.adapter_loads} |")
    stale = rows[0].fleet.publish_every_s
    lines += ["", "Replica-seconds: replicas times the simulated seconds they ran (a starting replica counts). "
              + ("The router read the replicas' stats fresh at every request." if not stale else
                 f"Replicas published their stats every {fmt(stale, 'time')}; the router added what it sent "
                 "since."), ""]
    return lines


def plot_replica_load(runs: list, path: Path):
    """Per contender (first repeat), each replica's work in hand over time as a heat map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in runs if getattr(r, "fleet", None) is not None and r.repeat == 0]
    fig, axes = plt.subplots(len(rows), 1, figsize=(8, 1.2 + 1.6 * len(rows)), squeeze=False)
    top = max((w for r in rows for series in r.fleet.load_work_s for w in series if w is not None), default=1.0)
    for ax, r in zip(axes[:, 0], rows):
        f = r.fleet
        t = f.load_t_s
        grid = np.full((len(f.load_work_s), len(t)), np.nan)
        for i, series in enumerate(f.load_work_s):
            for j, w in enumerate(series[:len(t)]):
                if w is not None:
                    grid[i, j] = w
        extent = (t[0] if t else 0.0, t[-1] if t else 1.0, len(f.load_work_s) - 0.5, -0.5)
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=top or 1.0,
                          extent=extent)
        ax.set_ylabel("replica")
        ax.set_title(f"{r.contender}: {f.replicas} replicas, {f.router}"
                     + (f", autoscale {f.autoscale}" if f.autoscale else "") + f"; {f.replica_s:.0f} replica-s",
                     fontsize=9)
        fig.colorbar(image, ax=ax, label="work in hand (s)", fraction=0.04)
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.suptitle("Predicted work in hand per replica over time (simulated)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig
