"""`stepserve bench --backend onnxruntime`: in-process contenders run their networks in onnxruntime, and the
results say so."""

from __future__ import annotations

import json

from extras import require

from stepserve.commands.bench import main


def test_bench_runs_in_process_on_onnxruntime_and_records_the_backend(tiny_sd_path, tmp_path, monkeypatch):
    require("onnxruntime", "onnx")
    monkeypatch.setenv("STEPSERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    rc = main(["--model", str(tiny_sd_path), "--backend", "onnxruntime", "--strategies", "continuous",
               "--rate", "4", "--duration", "2", "--warmup", "0.5", "--steps", "2,4", "--threads", "1",
               "--slo-p95-ms", "5000", "--out", str(out), "--no-progress"])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["backend"] == "onnxruntime"
    assert results["summaries"][0]["completed"] > 0 and results["summaries"][0]["failed"] == 0
    assert "backend onnxruntime" in (out / "report.md").read_text()


def test_bench_refuses_an_unknown_backend(capsys):
    assert main(["--backend", "tvm"]) == 2
    err = capsys.readouterr().err
    assert "--backend" in err and "tvm" in err and "onnxruntime" in err
