"""`stepserve plan`: the answer N holds the SLO and N - 1 does not, the command writes plan.json and the plot,
and bad flags exit 2 with one line naming what is allowed."""

import json

import pytest

from stepserve.bench.workload import Mix
from stepserve.cli import main as stepserve_main
from stepserve.costs.latency_model import Curve, LatencyModel
from stepserve.sim.plan import PlanSpec, plan_strategy, simulate_fleet
from stepserve.commands.plan import main

A = (32, 32)
# about 16 requests/s per replica at batch 8 and 10 steps
MODEL = LatencyModel(step={A: Curve(((1, 0.02), (4, 0.035), (8, 0.05)))}, encode=Curve(((1, 0.002), (8, 0.004))),
                     decode={A: Curve(((1, 0.003), (8, 0.008)))}, reference_bucket=A, metadata={"model": "hand"})


def test_the_answer_holds_and_one_fewer_does_not():
    spec = PlanSpec(MODEL, 40.0, 0.6, Mix.from_steps([10]), ["continuous"], duration_s=15.0, seed=2)
    plan = plan_strategy(spec, "continuous")
    n = plan.replicas
    assert n is not None and n >= 2
    assert plan.at(n).held and plan.at(n).p95_s <= 0.6 and not plan.at(n).stopped_early
    below = plan.at(n - 1)
    assert not below.held and below.p95_s > 0.6 and not below.stopped_early  # simulated to the end
    _, again = simulate_fleet(spec, "continuous", n - 1, stop_early=False)
    assert again.p95_s > 0.6
    assert [p.replicas for p in plan.probes] == sorted({p.replicas for p in plan.probes})


def test_max_replicas_that_miss_give_no_answer():
    spec = PlanSpec(MODEL, 60.0, 0.1, Mix.from_steps([10]), ["continuous"], max_replicas=3, duration_s=5.0)
    plan = plan_strategy(spec, "continuous")  # 10 steps alone take 0.2 s: no count holds 100 ms
    assert plan.replicas is None and not plan.at(3).held and [p.replicas for p in plan.probes] == [1, 2, 3]


def test_cli_writes_plan_json_and_the_plot(tmp_path, capsys):
    path = tmp_path / "latency.json"
    MODEL.save(path)
    out = tmp_path / "plan"
    argv = ["plan", "--latency-model", str(path), "--rate", "30", "--slo-p95-ms", "700", "--steps", "6,10",
            "--duration", "8", "--strategy", "continuous,dynamic", "--router", "power_of_two", "--out", str(out),
            "--no-progress"]
    assert stepserve_main(argv) == 0
    data = json.loads((out / "plan.json").read_text())
    assert [s["strategy"] for s in data["strategies"]] == ["continuous", "dynamic"]
    for s in data["strategies"]:
        assert s["replicas"] >= 1 and s["p95_ms"] <= 700
        assert s["margin_ms"] == pytest.approx(700 - s["p95_ms"], abs=0.01)
    assert data["settings"]["router"] == "power_of_two"
    assert (out / "p95_vs_replicas.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "replicas" in printed and "continuous" in printed and "margin" in printed
    assert "   1 replica: p95" in printed and "1 replicas" not in printed  # every climb starts at one


@pytest.mark.parametrize("bad, says", [
    (["--router", "random"], "allowed: least_work, least_work_sampled, power_of_two, least_outstanding, round_robin"),
    (["--strategy", "continuous,fast"], "allowed: continuous, dynamic"),
    (["--rate", "-3"], "--rate"),
    (["--slo-p95-ms", "abc"], "--slo-p95-ms"),
    (["--max-replicas", "0"], "--max-replicas"),
    (["--steps", "8,x"], "--steps"),
    (["--bogus"], "unrecognized"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, bad, says):
    path = tmp_path / "latency.json"
    MODEL.save(path)
    base = {"--latency-model": str(path), "--rate": "10", "--slo-p95-ms": "500"}
    argv = [x for k, v in base.items() for x in (k, v)] + bad
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepserve plan:") and "\n" not in err and says in err


def test_missing_latency_model_file_exits_2(tmp_path, capsys):
    assert main(["--latency-model", str(tmp_path / "none.json"), "--rate", "1", "--slo-p95-ms", "9"]) == 2
    assert "--latency-model" in capsys.readouterr().err


def test_plan_sizes_the_default_strategy_first_by_default(tmp_path):
    from stepserve.commands.plan import parse
    from stepserve.scheduling import DEFAULT_STRATEGY

    MODEL.save(tmp_path / "latency.json")
    base = ["--latency-model", str(tmp_path / "latency.json"), "--rate", "1", "--slo-p95-ms", "900"]
    assert parse(base)[0].strategies == [DEFAULT_STRATEGY, "continuous", "dynamic"]
    assert parse(base + ["--devices", "2"])[0].strategies == [DEFAULT_STRATEGY]  # --devices plans one
