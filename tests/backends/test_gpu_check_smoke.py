"""scripts/gpu_check.sh runs on a GPU machine only now and then; its --smoke mode runs every phase at tiny sizes on
the CPU here, so the script cannot rot between those runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # every phase of the GPU check, compiled: about 25 s
def test_gpu_check_smoke_runs_every_phase_and_writes_a_loadable_latency_model(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--smoke", "--compile-backend", "aot_eager",
                           "--out", str(out), "--bench-duration", "1.5"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               "PYTHON": sys.executable, "PYTHON_SET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert [f["rows"] for f in report["forward"]] == [1, 2, 4]
    assert all(f["bare_s"] > 0 and f["engine_s"] > 0 and 0 < f["mfu"] for f in report["forward"])
    assert sorted(s["strategy"].split("(")[0] for s in report["strategies"]) == ["continuous", "dynamic", "none",
                                                                                 "static"]
    assert all(s["images_per_s"] > 0 for s in report["strategies"])
    from stepserve.costs import LatencyModel

    model = LatencyModel.load(out / "latency_model.json")
    assert model.step_s(1) > 0  # the file `stepserve simulate --latency-model` reads
    # one request over two ranks (gloo here): the same images as one process
    assert [r["case"] for r in report["parallel"]] == ["ulysses 2", "cfg parallel"]
    assert all(r["max_uint8_diff"] <= 1 and r["split_s"] > 0 for r in report["parallel"])
    for line in ("compiled vs eager", "engine/bare", "p95 ms", "split over 2 devices"):
        assert line in proc.stdout
