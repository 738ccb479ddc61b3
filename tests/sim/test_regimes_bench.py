"""benchmarks/regimes.py on a tiny setting: one regime, two contenders, one load, a few simulated seconds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def regimes():
    spec = importlib.util.spec_from_file_location("regimes", ROOT / "benchmarks" / "regimes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["regimes"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_regimes_runs_a_tiny_matrix(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert regimes().main(["--regimes", "cpu-embedded", "--contenders", "default,dynamic:10", "--loads", "0.7",
                           "--requests", "20", "--min-duration", "3", "--json", str(out),
                           "--png", str(tmp_path / "r.png")]) == 0
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["deadline"], r["contender"]) for r in rows] == [
        ("none", "default=slo"), ("none", "dynamic(10ms)"), ("3x", "default=slo"), ("3x", "dynamic(10ms)")]
    for r in rows:
        assert r["measured"] > 0 and 0 <= r["attainment"] <= 1 and r["p95_s"] >= r["p50_s"] > 0
        assert r["slowdown_p95"] >= 1.0 and r["goodput_rps"] >= 0
        assert r["done"] + r["refused"] + r["timed_out"] <= 1 + 1e-9
        if r["deadline"] == "none":  # nothing to refuse as infeasible or to give up
            assert r["refused"] == 0 and r["timed_out"] == 0
    meta = data["regimes"][0]
    assert meta["best_capacity"] in meta["capacity_rps"] and set(meta["standalone_s"]) == {"8", "20", "40"}
    printed = capsys.readouterr().out
    assert "| cpu-embedded | 0.7 | 3x | default=slo |" in printed and "wall time" in printed
    assert "the default within the margins in" in printed


@pytest.mark.slow  # ~15 s of real engines
def test_a_live_regime_runs_every_cell_with_repeats(tmp_path, capsys):
    """The live clock: the embedded model loaded for real, each cell's contenders run `--repeats` times."""
    out = tmp_path / "r.json"
    assert regimes().main(["--regimes", "live-embedded", "--contenders", "default,none", "--loads", "0.5",
                           "--steps", "2,4", "--requests", "6", "--min-duration", "1", "--repeats", "2",
                           "--live-capacity-s", "1", "--workdir", str(tmp_path), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["regimes"][0]["clock"] == "live" and data["regimes"][0]["repeats"] == 2
    for r in data["rows"]:
        assert len(r["repeats"]) == 2 and r["measured"] > 0 and r["p95_s"] >= r["p50_s"] > 0
        # the median of the repeats that completed any request (a repeat on a machine busy with other work can
        # complete none of its six: its p50 is then None and is left out of the median)
        p50s = sorted(x["p50_s"] for x in r["repeats"] if x["p50_s"] is not None)
        assert p50s and p50s[0] <= r["p50_s"] <= p50s[-1]


def test_a_contender_is_a_name_and_default_follows_the_engine():
    r = regimes()
    assert r.contender("default", 8).strategy == r.EngineOptions().strategy
    assert r.contender("dynamic:50", 4).name == "dynamic(50ms)" and r.contender("slo", 4).max_batch_size == 4


def test_simulate_runs_on_every_shipped_gpu_model(tmp_path):
    """The compute-bound model's full batch outlasts a capacity window sized on a lone request; the bench then
    measures again over a window scaled by the batch size instead of failing."""
    from stepserve.cli import main as stepserve_main

    for name in ("gpu-512-sublinear", "gpu-1024-compute-bound", "gpu-sd15-512"):
        out = tmp_path / name
        model = ROOT / "stepserve" / "models" / "latency" / f"{name}.json"
        assert stepserve_main(["simulate", "--latency-model", str(model), "--steps", "20,28,50", "--rate-frac", "0.7",
                               "--duration", "60", "--no-progress", "--strategies", "continuous,none",
                               "--out", str(out)]) == 0
        results = json.loads((out / "results.json").read_text())
        assert results["capacity"]["completed"] >= 3 and all(s["completed"] > 0 for s in results["summaries"])


def test_a_control_copy_runs_as_its_original_and_stays_out_of_the_verdict(tmp_path, capsys):
    """'none#2' is `none` again under its own label: on the simulated clock (exact charges) it measures exactly
    as the original, the control table says 1.00x, and the verdict's cells do not count it as a contender."""
    r = regimes()
    copy = r.contender("dynamic:50#2", 4)
    assert copy.name == "dynamic(50ms)#2" and copy.max_queue_delay_ms == 50 and copy.strategy == "dynamic"
    out = tmp_path / "r.json"
    assert r.main(["--regimes", "cpu-embedded", "--contenders", "default,none,none#2", "--loads", "0.7",
                   "--requests", "20", "--min-duration", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    for deadline in ("none", "3x"):
        none, twin = (next(x for x in rows if x["deadline"] == deadline and x["contender"] == name)
                      for name in ("none", "none#2"))
        assert {k: v for k, v in twin.items() if k != "contender"} == {k: v for k, v in none.items() if k != "contender"}
    printed = capsys.readouterr().out
    assert "| cpu-embedded | 0.7 | none | none#2 / none | 1.00x | 1.00x |" in printed
    text, _, _, cells = r.verdict(rows)
    assert cells == 2 and "#2" not in text
    # the verdict without the copy is the verdict with it
    assert r.verdict([x for x in rows if "#" not in x["contender"]]) == r.verdict(rows)


def test_standings_count_the_cells_each_contender_is_within_the_margins_of_the_best():
    """Per contender, the cells within 5% of the best p95 and attainment and 10% of the best p50 (the same test the
    verdict applies to the default); a contender that completed fewer requests is not within, a control copy is
    not counted."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import regimes_report

    def row(load, contender, p50, p95, attainment, done=1.0):
        return {"regime": "r", "load": load, "deadline": "none", "contender": contender, "p50_s": p50,
                "p95_s": p95, "attainment": attainment, "done": done}

    rows = [row(0.3, "default=slo", 1.0, 2.0, 0.9), row(0.3, "none", 1.05, 2.08, 0.9),
            row(0.3, "continuous", 1.2, 2.0, 0.9),  # p50 1.2x the best: not within
            row(0.7, "default=slo", 1.0, 2.0, 0.9), row(0.7, "none", 1.0, 2.0, 0.8),  # attainment 0.89x the best
            row(0.7, "continuous", 0.5, 1.0, 0.85, done=0.85),  # fastest, but completed fewer: not compared
            row(0.7, "none#2", 1.0, 2.0, 0.95)]  # a control copy: neither counted nor the best
    assert regimes_report.standings(rows) == {"default=slo": 2, "none": 1, "continuous": 0}
    _, within, _, cells = regimes_report.verdict(rows)
    assert (within, cells) == (2, 2)


def test_the_matrix_picture_draws_every_contender_against_the_best_of_its_cell(tmp_path):
    """benchmarks/regimes_plot.py: per cell, p95 over the cell's best p95 (among those that completed as many) and
    the attainment, the default first; a contender that completed fewer is drawn apart (faded)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import regimes_plot

    def row(regime, deadline, contender, p95, attainment, done=1.0):
        return {"regime": regime, "load": 0.7, "deadline": deadline, "contender": contender, "p50_s": p95 / 2,
                "p95_s": p95, "attainment": attainment, "done": done}

    rows = [row("a", "none", "none", 3.0, 0.5), row("a", "none", "default=slo", 2.0, 0.8),
            row("a", "3x", "default=slo", 1.0, 0.9), row("a", "3x", "none", 4.0, 0.6),
            row("a", "3x", "continuous", 0.5, 0.4, done=0.5),  # completed fewer: not the best, drawn faded
            row("a", "none", "none#2", 1.0, 0.9)]  # a control copy: not drawn
    out = tmp_path / "m.png"
    fig = regimes_plot.plot_regimes(rows, out)
    assert out.read_bytes()[:4] == b"\x89PNG"
    top, bottom = fig.axes
    drawn = {ln.get_label(): list(zip(ln.get_xdata(), ln.get_ydata()))
             for ln in top.lines if ln.get_label()[0] != "_"}
    assert list(drawn) == ["default=slo", "none", "continuous"]
    assert drawn["default=slo"] == [(0, 1.0), (1, 1.0)] and drawn["none"] == [(0, 1.5), (1, 4.0)]
    assert drawn["continuous"] == []  # only faded
    faded = [list(zip(ln.get_xdata(), ln.get_ydata())) for ln in top.lines if ln.get_label()[0] == "_"]
    assert [(1, 0.5)] in faded
    assert all(ln.get_alpha() == 0.5 for ln in top.lines if list(zip(ln.get_xdata(), ln.get_ydata())) == [(1, 0.5)])
    attainment = [list(zip(ln.get_xdata(), ln.get_ydata())) for ln in bottom.lines]
    assert [(0, 80.0), (1, 90.0)] in attainment and [(1, 40.0)] in attainment
