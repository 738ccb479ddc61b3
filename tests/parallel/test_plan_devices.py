"""`stepserve plan --devices D`: R replicas of degree N (R x N <= D), each replica charging its degree's latency
model; the table of the splits that use every device, and the split that holds the SLO with the fewest devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepserve.bench.workload import Mix
from stepserve.commands.plan import main
from stepserve.costs import LatencyModel
from stepserve.costs.degree import at_degree, parallel_entry
from stepserve.costs.latency_model import Curve
from stepserve.sim.plan import PlanSpec
from stepserve.sim.split_plan import Split, by_degree, cheapest, full_splits, simulate_split

A = (64, 64)
SHIPPED = Path(__file__).resolve().parents[2] / "stepserve" / "models" / "latency"
# compute-bound: a batch of n costs n steps of one; 10 steps alone take 1.0 s on one device, 0.6 s on two
ONE = LatencyModel(step={A: Curve(((1, 0.1), (2, 0.2)))}, encode=Curve(((1, 0.0),)), decode={A: Curve(((1, 0.0),))})
TWO = at_degree(ONE, 0.6, parallel_entry(ulysses=2))
MODELS = {1: ONE, 2: TWO}


def spec(rate: float, slo_s: float) -> PlanSpec:
    return PlanSpec(ONE, rate, slo_s, Mix.from_steps([10]), ["continuous"], duration_s=60.0, seed=1)


def test_the_full_splits_use_every_device():
    assert [s.label for s in full_splits(8, [1, 2, 4, 8])] == ["8x1", "4x2", "2x4", "1x8"]
    assert [s.label for s in full_splits(6, [8, 3, 1, 4])] == ["6x1", "2x3"]  # 4 does not divide 6; 8 > 6
    assert Split(2, 4).devices == 8


def test_a_replica_of_degree_n_steps_with_the_degree_n_curve():
    for split, alone_s in ((Split(1, 1), 1.0), (Split(1, 2), 0.6)):
        sp = simulate_split(spec(0.05, 5.0), MODELS, split, 0.05, "continuous")  # requests far apart: alone
        assert sp.probe.p50_s == pytest.approx(alone_s, abs=1e-6) and sp.probe.p95_s == pytest.approx(alone_s,
                                                                                                     abs=1e-6)
        assert sp.goodput_rps == pytest.approx(0.05) and sp.probe.goodput_frac == 1.0


def test_the_cheapest_split_counts_devices():
    # a loose SLO: one device holds it at a low rate, so splitting (2 devices) is not worth it
    c = cheapest(spec(0.1, 2.0), MODELS, 4, 0.1, "continuous")
    assert c.split == Split(1, 1) and c.probe.p95_s <= 2.0
    # an SLO under one device's 1.0 s: only a split replica holds it
    c = cheapest(spec(0.1, 0.8), MODELS, 4, 0.1, "continuous")
    assert c.split == Split(1, 2) and c.tried == {1: None, 2: 1}
    # more load than one split replica holds the SLO at (two requests at once take 1.2 s): two of them
    c = cheapest(spec(0.5, 0.8), MODELS, 4, 0.5, "continuous")
    assert c.split == Split(2, 2) and c.probe.held and c.tried == {1: None, 2: 2}
    # nothing of at most 3 devices holds it at that rate
    c = cheapest(spec(0.5, 0.8), MODELS, 3, 0.5, "continuous")
    assert c.split is None and c.probe is None and c.tried == {1: None, 2: None}


def test_one_model_per_degree():
    assert list(by_degree([TWO, ONE])) == [1, 2]
    with pytest.raises(ValueError, match="two latency models for 2 device"):
        by_degree([TWO, at_degree(ONE, 0.5, parallel_entry(cfg=True))])


def test_the_command_prints_the_split_table_and_the_choice(tmp_path, capsys):
    files = sorted(str(p) for p in SHIPPED.glob("gpu-1024-compute-bound*.json"))
    assert len(files) == 4
    out = tmp_path / "plan"
    argv = ["--devices", "8", "--latency-model", *files, "--rate", "0.2,0.8,1.4", "--slo-p95-ms", "3000",
            "--steps", "28", "--duration", "60", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines() if line[:4] in ("8x1 ", "4x2 ", "2x4 ", "1x8 ")]
    assert [(r[0], r[3]) for r in rows] == [(s, rate) for rate in ("0.2", "0.8", "1.4")
                                            for s in ("8x1", "4x2", "2x4", "1x8")]
    for r in rows:  # p50, p95, SLO, goodput (req/s), goodput (%)
        assert r[6] in ("holds", "misses") and r[8].endswith("%")
        assert (r[6] == "holds") == (r[5] != "inf" and float(r[5]) <= 3.0)
    assert all(r[6] == "misses" and r[4] == "4.30" for r in rows if r[0] == "8x1")  # 4.30 s alone on one H100
    # at a low rate a split replica alone holds 3 s: 1 replica of 4 devices does (1.63 s a request)
    assert "at 0.2 req/s: 1x4 (1 replica of 4 devices, 4 of 8 devices)" in printed
    data = json.loads((out / "plan.json").read_text())
    assert [s["split"] for s in data["full_splits"]][:4] == ["8x1", "4x2", "2x4", "1x8"]
    assert data["cheapest"][0]["split"] == "1x4" and data["devices"] == 8


@pytest.mark.parametrize("argv, says", [
    (["-m", "ONE", "--rate", "1,2"], "--rate: one rate (several, comma-separated, only with --devices)"),
    (["-m", "ONE", "TWO"], "--latency-model: one file (several, one per degree, only with --devices)"),
    (["-m", "ONE", "TWO", "CFG", "--devices", "4"], "two latency models for 2 device(s)"),
    (["-m", "TWO", "--devices", "1"], "--devices 1: every latency model holds more devices per replica (2)"),
    (["-m", "ONE", "--devices", "0"], "--devices: must be > 0"),
    (["-m", "ONE", "TWO", "--devices", "4", "--strategy", "slo,continuous"], "--strategy: --devices plans one"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, argv, says):
    paths = {}
    for name, m in (("ONE", ONE), ("TWO", TWO), ("CFG", at_degree(ONE, 0.5, parallel_entry(cfg=True)))):
        paths[name] = str(tmp_path / f"{name}.json")
        m.save(paths[name])
    argv = ["--latency-model" if a == "-m" else paths.get(a, a) for a in argv]
    assert main([*argv, "--slo-p95-ms", "900", "--out", str(tmp_path / "out")]
                + ([] if "--rate" in argv else ["--rate", "1"])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepserve plan:") and "\n" not in err and says in err
    assert not (tmp_path / "out").exists()


def test_a_replica_plan_on_a_split_model_says_each_replica_holds_its_devices(tmp_path, capsys):
    TWO.save(tmp_path / "two.json")
    assert main(["--latency-model", str(tmp_path / "two.json"), "--rate", "0.2", "--slo-p95-ms", "900", "--steps",
                 "10", "--duration", "20", "--strategy", "continuous", "--out", str(tmp_path / "p"),
                 "--no-progress"]) == 0
    assert "measured at ulysses 2: each replica holds 2 devices" in capsys.readouterr().err
