"""The same seed gives the same results.json from `stepserve simulate`, byte for byte apart from the environment
block (timestamps, versions); a different seed, or noise, changes the numbers."""

import json

from stepserve.costs import CostModel, LatencyModel
from stepserve.commands.simulate import main

WORKLOAD = ["--steps", "2,4,8", "--duration", "3", "--warmup", "0.5", "--capacity-duration", "2", "--no-progress",
            "--strategies", "continuous,dynamic,static,none,slo", "--timeout-slo", "--max-queue", "30",
            "--rate-frac", "0.9"]


def _latency_file(tmp_path):
    """The fake cost model, with a recorded spread of the decode cost so that --noise has something to draw."""
    model = LatencyModel.from_cost_model(CostModel()).to_dict()
    model["metadata"]["spread"] = {"decode": [{"bucket": [32, 32], "points": [[1, 0.002, 0.006], [2, 0.003, 0.009]]}]}
    path = tmp_path / "latency.json"
    path.write_text(json.dumps(model))
    return path


def _results(tmp_path, name, *extra):
    out = tmp_path / name
    assert main(["--latency-model", str(_latency_file(tmp_path)), *WORKLOAD, *extra, "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    results.pop("environment")  # wall-clock fields: when and where it ran
    return json.dumps(results, sort_keys=True)


def test_same_seed_same_results_and_a_new_seed_changes_them(tmp_path):
    first = _results(tmp_path, "a", "--seed", "7")
    assert first == _results(tmp_path, "b", "--seed", "7")
    assert first != _results(tmp_path, "c", "--seed", "8")
    summaries = json.loads(first)["summaries"]
    assert [s["contender"] for s in summaries] == ["continuous", "dynamic(10ms)", "dynamic(50ms)",
                                                     "dynamic(200ms)", "static", "none", "slo"]
    assert all(s["offered"] > 20 for s in summaries)


def test_noise_is_seeded(tmp_path):
    noisy = _results(tmp_path, "n1", "--seed", "7", "--noise", "1", "--repeats", "2")
    assert noisy == _results(tmp_path, "n2", "--seed", "7", "--noise", "1", "--repeats", "2")
    assert noisy != _results(tmp_path, "quiet", "--seed", "7", "--repeats", "2")
    runs = json.loads(noisy)["runs"]
    first = [r["latencies_s"] for r in runs if r["contender"] == "continuous"]
    assert len(first) == 2 and first[0] != first[1]  # each repeat draws its own noise
