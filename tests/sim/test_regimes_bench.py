"""benchmarks/regimes.py on a tiny setting: one regime, two contenders, one load, a few simulated seconds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def regimes():
    spec = importlib.util.spec_from_file_location("regimes", ROOT / "benchmarks" / "regimes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regimes_runs_a_tiny_matrix(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert regimes().main(["--regimes", "cpu-embedded", "--contenders", "default,dynamic:10", "--loads", "0.7",
                           "--requests", "20", "--min-duration", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["deadline"], r["contender"]) for r in rows] == [
        ("none", "default=continuous"), ("none", "dynamic(10ms)"), ("3x", "default=continuous"), ("3x", "dynamic(10ms)")]
    for r in rows:
        assert r["measured"] > 0 and 0 <= r["attainment"] <= 1 and r["p95_s"] >= r["p50_s"] > 0
        assert r["slowdown_p95"] >= 1.0 and r["goodput_rps"] >= 0
    meta = data["regimes"][0]
    assert meta["best_capacity"] in meta["capacity_rps"] and set(meta["standalone_s"]) == {"8", "20", "40"}
    printed = capsys.readouterr().out
    assert "| cpu-embedded | 0.7 | 3x | default=continuous |" in printed and "wall time" in printed


def test_a_contender_is_a_name_and_default_follows_the_engine():
    r = regimes()
    assert r.contender("default", 8).strategy == r.EngineOptions().strategy
    assert r.contender("dynamic:50", 4).name == "dynamic(50ms)" and r.contender("slo", 4).max_batch_size == 4
