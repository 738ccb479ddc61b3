"""What bench and simulate print: plain text on the terminal (report.md keeps its markdown); contenders that tie
are named once, not again among "the others"."""

from __future__ import annotations

from types import SimpleNamespace

from stepserve.bench.report import verdicts
from stepserve.commands.simulate import main as simulate_main
from stepserve.costs import CostModel, LatencyModel


def test_simulate_prints_plain_text_and_report_md_keeps_its_markdown(tmp_path, capsys):
    model = tmp_path / "latency.json"
    LatencyModel.from_cost_model(CostModel()).save(model)
    out = tmp_path / "out"
    assert simulate_main(["--latency-model", str(model), "--steps", "2,4", "--duration", "0.8", "--warmup", "0.3",
                          "--drain", "0.5", "--capacity-duration", "1.0", "--no-progress", "--seed", "3",
                          "--strategies", "continuous,none", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "p50 latency:" in printed and "**" not in printed and "`" not in printed, printed
    assert "**p50 latency**" in (out / "report.md").read_text()


def summary(name: str, value: float):
    spread = SimpleNamespace(median=value)
    return SimpleNamespace(contender=name, p50_s=spread, p95_s=spread, p99_s=spread, throughput_rps=spread,
                           goodput_rps=spread, slo_attainment=spread, completed=10, offered=10)


def test_tied_contenders_are_not_listed_again_among_the_others():
    results = SimpleNamespace(summaries=[summary("continuous", 0.5), summary("slo", 0.5), summary("none", 2.0)],
                              settings=SimpleNamespace(contenders=[], peers=[]), runs=[])
    p50 = next(v.text for v in verdicts(results) if v.metric == "p50 latency")
    assert p50.startswith("**p50 latency**: continuous, slo tie at 500 ms"), p50
    others = p50.split("best of the others: ", 1)[1]
    assert "none 2.00 s" in others and "continuous" not in others and "slo" not in others, p50
