"""The simulator against the live engine on the same trace, with the fake model: `stepserve bench --model fake`
sleeps what its cost model says, `stepserve simulate` charges the same costs on a simulated clock. Their
percentiles agree loosely (sleeping on a shared CI machine overshoots; the tight bound is benchmarks/sim_fidelity.py
on the real model)."""

from __future__ import annotations

import json

from stepserve.commands.bench import main as bench_main
from stepserve.cli import main as stepserve_main
from stepserve.costs import CostModel, LatencyModel

LOAD = ["--steps", "2,4,8", "--no-progress", "--seed", "5", "--strategies", "continuous,static",
        "--max-batch-size", "4"]


def _summaries(path):
    return {s["contender"]: s for s in json.loads((path / "results.json").read_text())["summaries"]}


def test_simulated_percentiles_follow_the_live_engine_on_the_same_trace(tmp_path):
    latency = tmp_path / "latency.json"
    LatencyModel.from_cost_model(CostModel()).save(latency)
    live, sim = tmp_path / "live", tmp_path / "sim"
    assert bench_main(["--model", "fake", "--rate-frac", "0.6", "--duration", "3", "--warmup", "0.5", "--drain", "2",
                       "--capacity-duration", "1.5", "--out", str(live), *LOAD]) == 0
    slo_ms = json.loads((live / "results.json").read_text())["slo_s"] * 1000
    assert stepserve_main(["simulate", "--latency-model", str(latency), "--load", "trace", "--trace",
                           str(live / "trace.jsonl"), "--duration", "3", "--warmup", "0.5", "--drain", "2",
                           "--slo-p95-ms", f"{slo_ms:.3f}", "--out", str(sim), *LOAD]) == 0
    want, got = _summaries(live), _summaries(sim)
    assert set(want) == set(got) == {"continuous", "static"}
    for name in want:
        assert got[name]["offered"] == want[name]["offered"] > 20  # the same requests
        # static may leave the last requests of the trace waiting for a full batch at the drain limit, live and
        # simulated alike; nothing else goes missing
        assert got[name]["failed"] == want[name]["failed"] == 0
        assert abs(got[name]["completed"] - want[name]["completed"]) <= 2
        for key in ("p50_s", "p95_s"):
            ratio = got[name][key]["median"] / want[name][key]["median"]
            assert 0.5 <= ratio <= 1.3, (name, key, ratio)
