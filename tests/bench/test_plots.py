"""Every plot the bench, the simulator and the planner write, rendered at a narrow and at a wide range: tick labels
never overlap, counts get whole-number ticks, the batch-size panels share one y axis and break while the engine
is idle, the planner's strategies stay visible where they share points, and titles say "Simulated" when the
results come from the simulator. The PNGs are kept under $STEPSERVE_TEST_ARTIFACTS/plots when that is set."""

from __future__ import annotations

import itertools
import math
import os
import random
from pathlib import Path

import pytest

from stepserve.bench import app
from stepserve.bench.metrics import StatusCounts
from stepserve.bench.plot_axes import log_ticks
from stepserve.bench.plots import (
    plot_batch_sizes,
    plot_latency_cdf,
    plot_throughput_vs_latency,
)
from stepserve.bench.results import BatchTimeline, CdfSeries, SweepPoint
from stepserve.bench.workload import Mix
from stepserve.commands.simulate import main as simulate_main
from stepserve.costs import CostModel, LatencyModel
from stepserve.sim.plan import PlanSpec, Probe, StrategyPlan
from stepserve.sim.plan_plot import plot_p95_vs_replicas

RANGES = {"narrow": (0.10, 0.12), "wide": (0.01, 100.0)}
# more latency ranges for the log axes: a few decades, under one decade, the crowded top of a decade, a single value
MORE_RANGES = {"decades": (0.001, 10000.0), "one-decade": (0.5, 3.0), "sub-decade": (0.3, 0.9),
               "top-of-decade": (0.02, 0.09), "one-value": (0.25, 0.25)}


@pytest.fixture
def artefacts(tmp_path) -> Path:
    root = os.environ.get("STEPSERVE_TEST_ARTIFACTS")
    folder = Path(root) / "plots" if root else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def spread(lo: float, hi: float, n: int, seed: int) -> list[float]:
    """n sorted values between lo and hi, even in log terms, jittered by the seed."""
    rng = random.Random(seed)
    return sorted(lo * (hi / lo) ** rng.random() for _ in range(n))


def shown_labels(axis) -> list:
    """The tick labels an axis draws: visible, with text, at a tick inside the view."""
    lo, hi = sorted(axis.get_view_interval())
    locs = axis.get_majorticklocs()
    ticks = axis.get_major_ticks(len(locs))
    eps = (hi - lo) * 1e-9
    return [t.label1 for loc, t in zip(locs, ticks)
            if lo - eps <= loc <= hi + eps and t.label1.get_visible() and t.label1.get_text()]


def assert_labels_apart(fig) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = shown_labels(axis)
            for a, b in itertools.combinations(labels, 2):
                box_a, box_b = a.get_window_extent(renderer), b.get_window_extent(renderer)
                assert not box_a.overlaps(box_b), (a.get_text(), b.get_text())


def assert_integer_ticks(axis) -> None:
    labels = shown_labels(axis)
    assert len(labels) >= 2
    for label in labels:
        assert float(label.get_text()).is_integer() and "." not in label.get_text(), label.get_text()


def title_of(fig) -> str:
    return fig._suptitle.get_text() if fig._suptitle else fig.axes[0].get_title()


@pytest.mark.parametrize("name", [*RANGES, *MORE_RANGES])
def test_latency_cdf_labels_never_overlap(name, artefacts):
    lo, hi = {**RANGES, **MORE_RANGES}[name]
    names = ("continuous", "dynamic(5ms)", "static")
    series = [CdfSeries(c, spread(lo, hi, 200, seed)) for seed, c in enumerate(names)]
    fig = plot_latency_cdf(series, math.sqrt(lo * hi), artefacts / f"latency_cdf_{name}.png", "Latency CDF (test)")
    assert_labels_apart(fig)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and len(shown_labels(ax.xaxis)) >= 2
    assert not title_of(fig).startswith("Simulated")


@pytest.mark.parametrize("lo, hi", [*RANGES.values(), *MORE_RANGES.values(), (0.101, 0.1012), (1e-4, 1e6)])
def test_log_ticks_are_round_spread_and_inside(lo, hi):
    if lo == hi:
        lo, hi = lo / 1.02, hi * 1.02
    ticks = log_ticks(lo, hi)
    assert len(ticks) >= 2 and ticks == sorted(ticks) and all(lo <= t <= hi for t in ticks)
    assert all(len(f"{t:.6g}") <= 7 for t in ticks)  # "0.105", "1e+06": never 0.30000000000000004


@pytest.mark.parametrize("name", RANGES)
def test_throughput_vs_latency_labels_never_overlap(name, artefacts):
    lo, hi = RANGES[name]
    counts = StatusCounts(offered=100, completed=100, rejected=0, failed=0, unfinished=0)
    points = [SweepPoint(c, rate, rate, counts, p95 * 0.8, p95, p95, rate * 0.95, None, None, True)
              for k, c in enumerate(("continuous", "dynamic(5ms)"))
              for rate, p95 in zip((1, 2, 4, 8, 16), spread(lo, hi, 5, k))]
    fig = plot_throughput_vs_latency(points, math.sqrt(lo * hi), artefacts / f"throughput_vs_latency_{name}.png",
                                     simulated=True)
    assert_labels_apart(fig)
    assert fig.axes[0].get_yscale() == "log" and title_of(fig).startswith("Simulated: ")


def timelines(span_s: float, most: int) -> tuple[list[BatchTimeline], tuple[float, float]]:
    """Three engines over span_s seconds, and an interval where every one of them sits idle: continuous climbs
    to `most` and back, static runs full batches, none runs one request at a time with long waits."""
    step = span_s / 200
    idle = (0.4 * span_s, 0.6 * span_s)
    out = []
    for name, sizes, busy in (("continuous", [*range(1, most + 1), *range(most, 0, -1)], 1.0),
                              ("static", [most], 1.0), ("none", [1], 0.3)):
        t_s, batch, took = [], [], []
        t = 0.0
        while t < span_s:
            if not idle[0] <= t < idle[1]:
                t_s.append(round(t, 6))
                batch.append(sizes[len(t_s) % len(sizes)])
                took.append(step * busy)
            t += step
        out.append(BatchTimeline(name, t_s, batch, took))
    return out, idle


@pytest.mark.parametrize("name, span_s, most", [("narrow", 0.5, 3), ("wide", 600.0, 32)])
def test_batch_sizes_share_integer_y_ticks_and_break_while_idle(name, span_s, most, artefacts):
    lines, idle = timelines(span_s, most)
    fig = plot_batch_sizes(lines, artefacts / f"batch_size_over_time_{name}.png")
    assert_labels_apart(fig)
    axes = fig.axes
    assert len(axes) == 3
    assert len({ax.get_ylim() for ax in axes}) == 1  # one y range for every panel ...
    assert all(axes[0].get_shared_y_axes().joined(axes[0], ax) for ax in axes[1:])  # ... because they share it
    for ax in axes:
        assert_integer_ticks(ax.yaxis)
        xs = ax.get_lines()[0].get_xdata()
        # no stretch of line crosses the idle interval: a NaN breaks it there
        for a, b in itertools.pairwise(xs):
            assert not (a <= idle[0] and b >= idle[1]), (a, b)
    none = axes[2].get_lines()[0].get_xdata()
    assert sum(math.isnan(x) for x in none) >= 150  # one request at a time, waiting between steps: a gap each


def test_batch_sizes_draw_nothing_without_steps(tmp_path):
    assert plot_batch_sizes([BatchTimeline("x", [], [], [])], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def plans(kind: str) -> tuple[PlanSpec, list[StrategyPlan]]:
    """narrow: three strategies with the same p95 at the same counts (the markers fall on one another);
    wide: 1 to 64 replicas, p95 from unknown (stopped early) to 50 ms."""
    latency = LatencyModel.from_cost_model(CostModel())
    if kind == "narrow":
        spec = PlanSpec(latency, 30.0, 0.115, Mix.from_steps([8]), ["continuous", "dynamic", "slo"])
        counts, p95s = (1, 2, 3, 4), (0.121, 0.118, 0.112, 0.102)
    else:
        spec = PlanSpec(latency, 400.0, 0.4, Mix.from_steps([8, 40]), ["continuous", "dynamic", "static"])
        counts, p95s = (1, 2, 4, 8, 16, 32, 64), (math.inf, math.inf, 9.5, 2.2, 0.61, 0.2, 0.05)
    out = []
    for k, strategy in enumerate(spec.strategies):
        probes = [Probe(n, p95 / 2, p95 * (1 + 0.01 * k if kind == "wide" else 1), p95 * 1.2, 100, 100, 0, 0, 0,
                        None, p95 <= spec.slo_s, not math.isfinite(p95), 10, 0.1) for n, p95 in zip(counts, p95s)]
        out.append(StrategyPlan(strategy, next((p.replicas for p in probes if p.held), None), probes))
    return spec, out


@pytest.mark.parametrize("kind", ["narrow", "wide"])
def test_p95_vs_replicas_keeps_every_strategy_visible(kind, artefacts):
    spec, planned = plans(kind)
    fig = plot_p95_vs_replicas(spec, planned, artefacts / f"p95_vs_replicas_{kind}.png")
    assert_labels_apart(fig)
    ax = fig.axes[0]
    assert_integer_ticks(ax.xaxis)
    assert title_of(fig).startswith("Simulated: ")
    series = [line for line in ax.get_lines() if line.get_label() in {
        f"{p.strategy} (needs {p.replicas})" if p.replicas else f"{p.strategy} (> {spec.max_replicas})"
        for p in planned}]
    assert len(series) == len(planned)
    assert len({line.get_marker() for line in series}) == len(series)  # a shape each,
    assert all(line.get_markerfacecolor() == "none" for line in series)  # hollow
    # the same point of every strategy lands in a different place on the image
    first = [line.get_transform().transform((line.get_xdata()[0], line.get_ydata()[0])) for line in series]
    assert all(abs(a[0] - b[0]) >= 1.5 for a, b in itertools.combinations(first, 2))


def test_simulate_marks_every_plot_and_records_step_durations(tmp_path, artefacts, monkeypatch):
    """`stepserve simulate` writes its plots through the bench's own outputs, each title saying Simulated."""
    figures = {}

    def keep(name, plot):
        def wrapped(*args, **kwargs):
            figures[name] = plot(*args, **kwargs)
            return figures[name]
        monkeypatch.setattr(app, name, wrapped)

    for name in ("plot_latency_cdf", "plot_throughput_vs_latency", "plot_batch_sizes"):
        keep(name, getattr(app, name))
    latency = tmp_path / "latency.json"
    LatencyModel.from_cost_model(CostModel()).save(latency)
    out = artefacts / "simulate"
    assert simulate_main(["--latency-model", str(latency), "--steps", "2,4", "--duration", "3", "--warmup", "0.3",
                          "--drain", "0.5", "--capacity-duration", "1.0", "--no-progress", "--seed", "3",
                          "--strategies", "continuous,static", "--rate", "20", "--sweep", "--sweep-rates", "10,40",
                          "--sweep-duration", "1", "--out", str(out)]) == 0
    assert set(figures) == {"plot_latency_cdf", "plot_throughput_vs_latency", "plot_batch_sizes"}
    for name, fig in figures.items():
        assert title_of(fig).startswith("Simulated: "), name
        assert_labels_apart(fig)
    assert_integer_ticks(figures["plot_batch_sizes"].axes[0].yaxis)
