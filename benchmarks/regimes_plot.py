"""The regime matrix as one picture: in every cell, how far each contender is from the best one.

Top: p95 latency over the best p95 of the cell (log scale; among the contenders that completed as many requests,
as the verdict compares them; a contender that completed fewer is drawn faded at its own p95 over that best).
Bottom: SLO attainment (requests completed within 3x their standalone latency; refused and unfinished ones are
misses). The shaded band on top is the 5% margin of the acceptance test. Cells are grouped by regime; within a
regime: loads 0.3, 0.7, 0.9 without deadlines, then the same loads with deadlines.

    python benchmarks/regimes_plot.py docs/regimes.json docs/regimes.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stepserve.bench.plot_axes import log_axis, new_figure, save, series_style

sys.path.insert(0, str(Path(__file__).resolve().parent))
from regimes_report import cells_of, comparable  # noqa: E402

P95_MARGIN = 1.05


def contender_order(rows: list[dict]) -> list[str]:
    """The default first, then the others in the order the matrix ran them (control copies left out)."""
    names = list(dict.fromkeys(r["contender"] for r in rows if "#" not in r["contender"]))
    return sorted(names, key=lambda n: not n.startswith("default"))


def plot_regimes(rows: list[dict], path: Path, simulated: bool = True):
    """Draw the two panels for `rows` (regimes.py's JSON rows) into `path`; returns the figure."""
    cells = cells_of(rows)
    keys = sorted(cells, key=lambda k: (list(dict.fromkeys(r["regime"] for r in rows)).index(k[0]),
                                        k[2] != "none", k[1]))
    names = contender_order(rows)
    fig = new_figure(max(8.0, 0.36 * len(keys) + 2.5), 7.0)
    top = fig.add_subplot(2, 1, 1)
    bottom = fig.add_subplot(2, 1, 2, sharex=top)
    ratios = []
    for i, name in enumerate(names):
        default = name.startswith("default")
        style = {**series_style(i), "color": "black" if default else f"C{i}", "zorder": 5 if default else 2,
                 "linestyle": "-" if default else "none"}
        if default:
            style.update(markerfacecolor="black", markersize=5)
        xs, faded, atts = [], [], []
        for x, key in enumerate(keys):
            ok = comparable(cells[key])
            row = next((r for r in cells[key] if r["contender"] == name), None)
            if row is None or not ok:
                continue
            best = min(r["p95_s"] for r in ok)
            if row["p95_s"] is not None:
                (xs if row in ok else faded).append((x, row["p95_s"] / best))
                ratios.append(row["p95_s"] / best)
            atts.append((x, 100 * (row["attainment"] or 0)))
        top.plot([x for x, _ in xs], [y for _, y in xs], label=name, **style)
        if faded:
            top.plot([x for x, _ in faded], [y for _, y in faded],
                     **{**style, "linestyle": "none", "markerfacecolor": "none", "alpha": 0.5})
        bottom.plot([x for x, _ in atts], [y for _, y in atts], **style)
    log_axis(top, "y", ratios + [1.0, P95_MARGIN])
    top.axhspan(1.0, P95_MARGIN, color="tab:green", alpha=0.15, lw=0)
    top.set_ylabel("p95 / best p95 of the cell")
    title = "Every contender against the best of each cell (default: black line)"
    top.set_title(f"Simulated: {title}" if simulated else title, pad=30)
    top.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=8, ncol=len(names), frameon=False)
    top.tick_params(labelbottom=False)
    bottom.set_ylabel("SLO attainment (%)")
    bottom.set_ylim(-3, 103)
    regimes = list(dict.fromkeys(k[0] for k in keys))
    for ax in (top, bottom):
        ax.grid(True, axis="y", alpha=0.3)
        for j, regime in enumerate(regimes):  # a separator between regimes
            first = next(x for x, k in enumerate(keys) if k[0] == regime)
            if j:
                ax.axvline(first - 0.5, color="grey", lw=0.8)
    bottom.set_xticks(range(len(keys)))
    bottom.set_xticklabels([f"{k[1]:g}{'' if k[2] == 'none' else ' ' + k[2]}" for k in keys], rotation=90,
                           fontsize=7)
    for regime in regimes:  # named on the attainment panel's top edge
        xs = [x for x, k in enumerate(keys) if k[0] == regime]
        bottom.text((xs[0] + xs[-1]) / 2, 1.01, regime, transform=bottom.get_xaxis_transform(), ha="center",
                    va="bottom", fontsize=8)
    bottom.set_xlabel("cell: load (x the best capacity), and '3x' where each request has a deadline of 3x its "
                      "standalone latency")
    return save(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="regimes.py --json output")
    p.add_argument("png", type=Path, help="where to write the picture")
    args = p.parse_args(argv)
    data = json.loads(args.results.read_text())
    live = any(m.get("clock") == "live" for m in data.get("regimes", []))
    plot_regimes(data["rows"], args.png, simulated=not live)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
