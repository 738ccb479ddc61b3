"""`stepserve simulate`: a bench command line with the verb swapped and --latency-model for --model writes the
bench's files with the bench's schema, runs the server's own engine and policies, and loses no request."""

import asyncio
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from stepserve.commands.bench import main as bench_main
from stepserve.bench.runner import LoadPlan, run_contender
from stepserve.bench.targets import FAILED, OK, REJECTED, TIMEOUT, UNFINISHED, Contender
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.cli import main as stepserve_main
from stepserve.costs import CostModel, FakeExecutor, LatencyCharges, LatencyModel
from stepserve.engine.core import EngineCore
from stepserve.scheduling.continuous import ContinuousBatchingPolicy
from stepserve.scheduling.slo import SLOPolicy
from stepserve.sim.bench import SimSetup, SimulatedDriver, contender_maker, make_core
from stepserve.commands.simulate import main
from stepserve.sim.drive import drive_open

WORKLOAD = ["--steps", "2,4", "--duration", "0.8", "--warmup", "0.3", "--drain", "0.5", "--capacity-duration", "1.0",
            "--no-progress", "--seed", "3", "--strategies", "continuous,dynamic", "--dynamic-delays-ms", "5"]


@pytest.fixture
def latency_file(tmp_path):
    """The fake executor's cost model as a latency model: what `--model fake` sleeps, simulate charges."""
    path = tmp_path / "latency.json"
    LatencyModel.from_cost_model(CostModel()).save(path)
    return path


def _keys(value, depth=2):
    """The shape of a JSON value: its keys, nested `depth` levels (lists: their first element)."""
    if isinstance(value, list):
        return [_keys(value[0], depth)] if value else []
    if isinstance(value, dict) and depth > 0:
        return {k: _keys(v, depth - 1) for k, v in value.items()}
    return None


def test_bench_command_line_simulated_writes_the_bench_schema(tmp_path, latency_file, capsys):
    sim_out, bench_out = tmp_path / "sim", tmp_path / "bench"
    assert bench_main(["--model", "fake", *WORKLOAD, "--out", str(bench_out)]) == 0
    assert stepserve_main(["simulate", "--latency-model", str(latency_file), *WORKLOAD, "--out", str(sim_out)]) == 0
    assert "report:" in capsys.readouterr().out
    assert {"results.json", "report.md", "latency_cdf.png", "trace.jsonl", "latency_model.json"} <= {
        p.name for p in sim_out.iterdir()}
    with Image.open(sim_out / "latency_cdf.png") as im:
        assert im.size[0] > 100
    sim = json.loads((sim_out / "results.json").read_text())
    bench = json.loads((bench_out / "results.json").read_text())
    assert list(sim) == list(bench) and sim["schema"] == bench["schema"]
    for key in ("settings", "runs", "summaries", "idle", "capacity", "cdf", "timelines"):
        assert _keys(sim[key]) == _keys(bench[key]), key
    assert sim["environment"]["command"].startswith("stepserve simulate --latency-model")
    assert [s["contender"] for s in sim["summaries"]] == ["continuous", "dynamic(5ms)"]
    assert sim["settings"]["seed"] == 3 and sim["settings"]["device"].startswith("simulated")
    # the same seed: the same trace, request for request, as the live bench replayed
    assert (sim_out / "trace.jsonl").read_text().count("\n") > 0
    # simulated costs are what the fake model sleeps: idle latencies agree loosely (sleeping overshoots)
    for s, b in zip(sim["idle"], bench["idle"]):
        assert s["steps"] == b["steps"] and 0.5 < s["latency_s"] / b["latency_s"] <= 1.05
    report = (sim_out / "report.md").read_text()
    assert "| continuous |" in report and "simulated engine" in report
    # every simulated output says so; bench's do not
    assert sim["clock"] == "simulated" and bench["clock"] == "wall"
    assert report.startswith("# stepserve benchmark (simulated)")
    assert (bench_out / "report.md").read_text().startswith("# stepserve benchmark\n")
    # report.html: the same report with every plot embedded, nothing fetched from elsewhere
    page = (bench_out / "report.html").read_text()
    assert "<table>" in page and "<td>continuous</td>" in page and "<h2>" in page
    plots = sorted(p.name for p in bench_out.glob("*.png"))
    assert plots and page.count('src="data:image/png;base64,') == len(plots)
    assert all(name in page for name in plots) and "http" not in page.replace("http-equiv", "")


def test_simulate_and_bench_write_to_their_own_default_folders():
    from stepserve.commands.bench import config_from_args
    from stepserve.commands.simulate import parse

    assert config_from_args(["--model", "fake"]).out == Path("bench-out")
    assert parse(["--latency-model", "x.json"])[0].out == Path("sim-out")


def test_simulate_help_shows_only_the_flags_it_honours(capsys):
    assert stepserve_main(["simulate", "--help"]) == 0
    text = capsys.readouterr().out
    usage, options = text.split("\n\n", 1)[0], text.split("options:", 1)[1]  # the description may name them
    for flag in ("--target", "--peers", "--api-key", "--device", "--dtype", "--backend", "--threads", "--model"):
        whole = re.compile(rf"(?<![\w-]){flag}(?![\w-])")  # --target-ongoing-requests is a fleet flag of its own
        assert not whole.search(usage) and not whole.search(options), flag
    assert "--strategies" in text and "--noise" in text and "sim-out" in text


def test_closed_loop_and_trace_loads_simulate(tmp_path, latency_file):
    out = tmp_path / "closed"
    assert main(["--latency-model", str(latency_file), *WORKLOAD, "--load", "closed", "--users", "4",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["runs"][0]["mode"] == "closed-loop" and results["summaries"][0]["completed"] > 10
    replay = tmp_path / "replay"
    assert main(["--latency-model", str(latency_file), *WORKLOAD, "--load", "trace",
                 "--trace", str(_trace(tmp_path)), "--out", str(replay)]) == 0
    runs = json.loads((replay / "results.json").read_text())["runs"]
    assert runs[0]["counts"]["offered"] == 30 - 3  # 3 requests fall in the 0.3 s warm-up


def test_sweep_finds_each_contenders_knee(tmp_path, latency_file):
    out = tmp_path / "sweep"
    assert main(["--latency-model", str(latency_file), *WORKLOAD, "--rate", "20", "--sweep", "--sweep-duration", "2",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "throughput_vs_latency.png").is_file()
    knees = {k["contender"]: k for k in results["knees"]}
    assert set(knees) == {"continuous", "dynamic(5ms)"}
    # continuous batching holds the SLO at a higher rate than dynamic batching on the same costs
    assert knees["continuous"]["rate_rps"] is not None
    assert knees["continuous"]["rate_rps"] >= (knees["dynamic(5ms)"]["rate_rps"] or 0)
    points = [p for p in results["sweep"] if p["contender"] == "continuous"]
    assert len(points) >= 3 and any(not p["held"] for p in points)


def _trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"offset_s": 0.1 * i, "prompt": "a seven", "num_inference_steps": 4}) + "\n"
                            for i in range(30)))
    return path


@pytest.mark.parametrize("with_model, argv, message", [
    (False, [], "--latency-model FILE is required"),
    (True, ["--model", "fake"], "--model: simulate runs no model"),
    (False, ["--target", "http://127.0.0.1:9"], "--target: a server cannot be simulated"),
    (True, ["--noise", "-1"], "--noise: must be a number >= 0"),
    (True, ["--strategies", "bogus"], "--strategies: bogus not supported"),
])
def test_bad_command_lines_fail_with_one_line(with_model, argv, message, latency_file, tmp_path, capsys):
    given = ["--latency-model", str(latency_file)] if with_model else []
    assert main([*given, *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepserve simulate: ") and message in err and "\n" not in err


def test_missing_or_spreadless_latency_model_fails_cleanly(tmp_path, latency_file, capsys):
    assert main(["--latency-model", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")]) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert main(["--latency-model", str(latency_file), "--noise", "0.5", "--out", str(tmp_path / "o")]) == 2
    assert "spread" in capsys.readouterr().err


def test_the_simulator_runs_the_servers_engine_and_policies(latency_file):
    latency = LatencyModel.load(latency_file)
    setup = SimSetup(latency)
    core = make_core(setup, Contender("continuous", max_batch_size=4), 0)
    assert type(core) is EngineCore and type(core.policy) is ContinuousBatchingPolicy
    assert core.policy.max_batch_size == 4 and isinstance(core.executor, FakeExecutor)
    assert isinstance(core.executor.cost, LatencyCharges) and core.executor.cost.latency is latency
    slo = make_core(setup, Contender("slo"), 0)
    assert type(slo.policy) is SLOPolicy and slo.policy.latency_model.prior is latency


def test_nothing_is_lost_under_overload_deadlines_and_a_queue_bound(latency_file):
    """Every request of the trace ends in exactly one bench status, and the counts add up to what was offered."""
    latency = LatencyModel.load(latency_file)
    setup = SimSetup(latency)
    mix = Mix.from_steps([4, 40])
    trace = poisson_trace(mix, 60.0, 4.0, seed=1).with_timeout(1.0)  # far over capacity
    plan = LoadPlan("open", mix, 1, 0.5, trace.duration_s, 0.3, trace=trace, rate_rps=60.0, timeout_s=1.0)
    for contender in (Contender("continuous", max_queue=20), Contender("slo", max_queue=20), Contender("none")):
        run = asyncio.run(run_contender(SimulatedDriver(setup), contender_maker(contender), plan, 0, 0.5, False))
        c = run.metrics.counts
        assert c.offered == sum(1 for it in trace.items if it.offset_s >= 0.5)
        assert c.completed + c.rejected + c.failed + c.unfinished + c.deadline_missed == c.offered
        assert c.rejected + c.deadline_missed + c.unfinished > 0, contender.name  # overloaded: not all served
        assert c.completed > 0 or contender.strategy == "none"  # one at a time, everything queues past 1 s
    driven = drive_open(make_core(setup, Contender("continuous", max_queue=20), 0), trace, 0.0, 100.0)
    statuses = [o.status for o in driven.outcomes]
    assert len(statuses) == len(trace.items) and set(statuses) <= {OK, REJECTED, FAILED, TIMEOUT, UNFINISHED}
    assert UNFINISHED not in statuses  # with time to drain, every request gets an answer
    assert all(o.done_s >= o.scheduled_s for o in driven.outcomes)
