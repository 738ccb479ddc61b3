"""End to end on the fake model (it sleeps its modelled time): the report files are written and parse."""

import json

import pytest
from PIL import Image

from stepserve.commands.bench import main

FAST = ["--model", "fake", "--steps", "2,4", "--duration", "0.8", "--warmup", "0.3", "--drain", "0.5",
        "--capacity-duration", "1.0", "--no-progress", "--seed", "3"]


def test_comparison_with_sweep_writes_every_file(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(FAST + ["--strategies", "continuous,dynamic", "--dynamic-delays-ms", "5,20", "--rate", "20",
                      "--sweep", "--sweep-rates", "10,40", "--sweep-duration", "0.5", "--sweep-min-requests", "0",
                      "--out", str(out)])
    assert rc == 0
    names = {p.name for p in out.iterdir()}
    assert {"results.json", "report.md", "latency_cdf.png", "throughput_vs_latency.png",
            "batch_size_over_time.png", "trace.jsonl"} <= names
    for png in ("latency_cdf.png", "throughput_vs_latency.png", "batch_size_over_time.png"):
        with Image.open(out / png) as im:
            assert im.size[0] > 100

    results = json.loads((out / "results.json").read_text())
    contenders = ["continuous", "dynamic(5ms)", "dynamic(20ms)"]
    assert [s["contender"] for s in results["cdf"]] == contenders  # one CDF series per contender
    assert all(s["latencies_s"] == sorted(s["latencies_s"]) for s in results["cdf"])
    assert [s["contender"] for s in results["summaries"]] == contenders
    env = results["environment"]
    assert env["command"].startswith("stepserve bench --model fake") and env["versions"]["torch"]
    assert results["settings"]["seed"] == 3 and results["settings"]["rate_rps"] == 20
    assert [c["strategy"] for c in results["settings"]["contenders"]] == ["continuous", "dynamic", "dynamic"]
    assert [i["steps"] for i in results["idle"]] == [2, 4]
    assert results["slo_s"] == pytest.approx(2 * results["idle"][-1]["latency_s"])
    run = results["runs"][0]
    for key in ("latency", "queue", "denoise", "decode", "first_step", "counts", "throughput_rps", "goodput_rps",
                "slo_attainment", "busy_fraction", "batch_sizes", "usage", "send_lag"):
        assert key in run
    assert 0 < run["busy_fraction"] <= 1.05
    assert {p["rate_rps"] for p in results["sweep"]} <= {10.0, 40.0}
    assert [k["contender"] for k in results["knees"]] == contenders
    assert results["conclusions"]

    report = (out / "report.md").read_text()
    for heading in ("## Latency", "## Throughput", "## Rate sweep", "## Conclusion", "Warm-up excluded"):
        assert heading in report
    printed = capsys.readouterr().out
    assert "report.md" in printed and "wins" in printed


def test_closed_loop_is_labelled(tmp_path):
    out = tmp_path / "closed"
    rc = main(FAST + ["--strategies", "continuous", "--load", "closed", "--users", "3", "--slo-p95-ms", "500",
                      "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["runs"][0]["mode"] == "closed-loop"
    assert "closed-loop" in (out / "report.md").read_text()
    assert results["capacity"] is None and results["slo_s"] == 0.5
    assert not (out / "throughput_vs_latency.png").exists()


def test_trace_replay(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"offset_s": i * 0.05, "prompt": "a one", "num_inference_steps": 2}) + "\n"
                             for i in range(20)))
    out = tmp_path / "replay"
    assert main(FAST + ["--strategies", "continuous", "--load", "trace", "--trace", str(trace), "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["runs"][0]["counts"]["offered"] == sum(1 for i in range(20) if i * 0.05 >= 0.3)


@pytest.mark.parametrize("argv, fragment", [
    (["--strategies", "continuous,bogus"], "allowed: continuous, dynamic, static, none"),
    (["--load", "sometimes"], "choose from"),
    (["--rate", "-1"], "--rate: must be > 0"),
    (["--load", "trace"], "--load trace needs --trace"),
    (["--steps", "a,b"], "comma-separated"),
    (["--rate", "1", "--rate-frac", "0.5"], "not allowed with"),
])
def test_bad_flags_get_one_line_errors(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err and err.startswith("stepserve bench:")


def test_demo_defaults_compare_every_strategy_on_a_mixed_workload():
    from stepserve.commands.demo import DEFAULT_OUT, config_from_args

    cfg = config_from_args([])
    assert [c.name for c in cfg.contenders] == ["slo", "continuous", "dynamic(10ms)", "dynamic(50ms)", "dynamic(200ms)",
                                                "static", "none"]
    assert cfg.mix.steps.values == [8, 20, 40] and cfg.rate_frac == 0.7 and cfg.load == "poisson"
    assert cfg.model == "embedded" and cfg.out == DEFAULT_OUT and cfg.keep_images


def test_demo_missing_model_is_one_line(tmp_path, capsys):
    from stepserve.commands.demo import main as demo_main

    assert demo_main(["--model", str(tmp_path / "nowhere"), "--no-progress", "--out", str(tmp_path / "o")]) == 1
    assert "nowhere" in capsys.readouterr().err.strip().splitlines()[-1]
