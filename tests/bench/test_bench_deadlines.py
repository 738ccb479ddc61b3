"""Deadlines in the benchmark: every request carries the run's timeout_s, slo contenders get one latency model,
refusals are timed, deadline misses are counted apart from other failures, and late OK answers are caught."""

import asyncio
import json

import pytest
from aiohttp import web

from stepserve.commands.bench import UsageError, config_from_args, main
from stepserve.scheduling import STRATEGIES
from stepserve.bench.load import run_open_loop
from stepserve.bench.metrics import Usage, summarize
from stepserve.bench.repeats import summarize_repeats
from stepserve.bench.runner import NO_DEADLINE_S
from stepserve.bench.targets import FAILED, OK, REJECTED, TIMEOUT, HttpTarget, Reply
from stepserve.bench.trace_files import load_trace
from stepserve.bench.workload import RequestSpec, Trace, TraceItem
from stepserve.costs import CostModel, LatencyModel

FAST = ["--model", "fake", "--steps", "2,4", "--duration", "0.8", "--warmup", "0.3", "--drain", "0.5",
        "--capacity-duration", "1.0", "--no-progress", "--seed", "3"]


@pytest.fixture
def engine_models(monkeypatch):
    """(strategy, latency_model) of every in-process engine built."""
    from stepserve.engine.async_engine import AsyncEngine

    built = []
    original = AsyncEngine.__init__

    def init(self, executor, *args, **options):
        original(self, executor, *args, **options)
        built.append((self.options.strategy, self.options.latency_model))

    monkeypatch.setattr(AsyncEngine, "__init__", init)
    return built


# --- every request carries the deadline ----------------------------------------------------------------------------
def test_timeout_slo_gives_every_request_the_slo(tmp_path, submitted):
    out = tmp_path / "out"
    rc = main(FAST + ["--strategies", "continuous", "--rate", "10", "--timeout-slo", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    slo_s = results["slo_s"]
    assert slo_s == pytest.approx(2 * results["idle"][-1]["latency_s"])
    assert results["settings"]["timeout_s"] == slo_s
    assert "--timeout-slo" in results["settings"]["timeout_rule"]

    idle = 2 * 4  # idle latency: one warm-up and three measured requests per step count, without a deadline
    # explicitly without a deadline, so that a server's default --timeout-s cannot cut the probes short either
    assert [p.timeout_s for p in submitted[:idle]] == [NO_DEADLINE_S] * idle
    trace = load_trace(out / "trace.jsonl")
    assert len(submitted) == idle + len(trace.items)  # every request of the run reached the engine...
    assert {p.timeout_s for p in submitted[idle:]} == {slo_s}  # ...carrying the SLO as its deadline
    assert {it.spec.timeout_s for it in trace.items} == {slo_s}  # and the saved trace replays it

    run = results["runs"][0]
    counts = run["counts"]
    assert counts["completed"] + counts["rejected"] + counts["failed"] + counts["unfinished"] + \
        counts["deadline_missed"] == counts["offered"]
    assert run["late_ok"] >= 0 and "refusal" in run
    report = (out / "report.md").read_text()
    assert f"- Deadlines: every request carries timeout_s = {slo_s * 1000:.0f} ms" in report
    assert "| deadline missed | late OK |" in report


def test_timeout_s_closed_loop(tmp_path, submitted):
    out = tmp_path / "closed"
    rc = main(FAST + ["--strategies", "continuous", "--load", "closed", "--users", "2", "--slo-p95-ms", "500",
                      "--timeout-s", "2.5", "--out", str(out)])
    assert rc == 0
    assert {p.timeout_s for p in submitted[8:]} == {2.5} and len(submitted) > 8
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["timeout_s"] == 2.5 and results["settings"]["timeout_rule"] == "--timeout-s"
    assert "timeout_s 2.5 s" in results["load_description"]


def test_request_spec_carries_timeout_to_params_and_http_body():
    spec = RequestSpec("a seven", 1, num_inference_steps=4, timeout_s=1.5)
    assert spec.to_params().timeout_s == 1.5
    assert spec.to_http()["timeout_s"] == 1.5
    assert "timeout_s" not in RequestSpec("a seven", 1).to_http()
    assert RequestSpec("a seven", 1).to_params().timeout_s is None
    trace = Trace([TraceItem(0.0, RequestSpec("p", 0)), TraceItem(0.1, RequestSpec("p", 1, timeout_s=9.0))])
    assert [it.spec.timeout_s for it in trace.with_timeout(0.5).items] == [0.5, 0.5]
    assert trace.with_timeout(None) is trace
    assert trace.items[0].spec.timeout_s is None  # the original is left alone


def test_trace_file_timeout_must_be_positive(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"offset_s": 0, "prompt": "p", "timeout_s": 0}\n')
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        load_trace(path)
    path.write_text('{"offset_s": 0, "prompt": "p", "timeout_s": 1.25}\n{"offset_s": 1, "prompt": "q"}\n')
    assert [it.spec.timeout_s for it in load_trace(path).items] == [1.25, None]


# --- slo contenders ------------------------------------------------------------------------------------------------
def test_slo_contender_with_a_latency_model_file_refuses_and_times_refusals(tmp_path, engine_models):
    model = LatencyModel.from_cost_model(CostModel())
    model_file = tmp_path / "fake_model.json"
    model.save(model_file)
    out = tmp_path / "slo"
    # 150 req/s is several times what batch 4 can serve: slo must refuse at arrival what it cannot finish in time
    rc = main(FAST + ["--strategies", "continuous,slo", "--max-batch-size", "4", "--rate", "150", "--timeout-slo",
                      "--latency-model", str(model_file), "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert "loaded from" in results["settings"]["latency_model"]
    assert results["startup"]["latency_model_s"] is None  # loaded, not measured
    assert LatencyModel.load(out / "latency_model.json") == model
    slo_models = [m for strategy, m in engine_models if strategy == "slo"]
    assert slo_models and all(m == model for m in slo_models)
    assert all(m is None for strategy, m in engine_models if strategy != "slo")

    run = next(r for r in results["runs"] if r["contender"] == "slo")
    counts, refusal = run["counts"], run["refusal"]
    assert counts["rejected"] > 0
    assert refusal["count"] == counts["rejected"]
    assert 0 <= refusal["p50_ms"] <= refusal["p99_ms"] <= refusal["max_ms"] < 1000
    assert run["rejected_reasons"] == {"deadline_infeasible": counts["rejected"]}
    assert counts["completed"] + counts["rejected"] + counts["failed"] + counts["unfinished"] + \
        counts["deadline_missed"] == counts["offered"]
    summary = next(s for s in results["summaries"] if s["contender"] == "slo")
    assert summary["refusal_p50_ms"]["median"] == refusal["p50_ms"]
    assert summary["deadline_missed"] == counts["deadline_missed"] and summary["late_ok"] == run["late_ok"]
    cont = next(r for r in results["runs"] if r["contender"] == "continuous")
    assert cont["counts"]["rejected"] == 0 and cont["counts"]["deadline_missed"] > 0  # it only times out

    report = (out / "report.md").read_text()
    assert "## Refusals: how quickly they were told" in report and "deadline_infeasible" in report
    assert "- slo latency model: loaded from" in report


def test_slo_latency_model_is_measured_once_and_shared(tmp_path, monkeypatch, engine_models):
    calls = []
    model = LatencyModel.from_cost_model(CostModel())

    def measure(executor, max_batch_size, progress=None):
        calls.append(max_batch_size)
        return model

    monkeypatch.setattr("stepserve.profiling.measure_latency_model", measure)
    out = tmp_path / "measured"
    rc = main(FAST + ["--strategies", "slo", "--max-batch-size", "3", "--rate", "20", "--timeout-s", "0.5",
                      "--repeats", "2", "--out", str(out)])
    assert rc == 0
    assert calls == [3]  # once, on the shared executor, up to the contenders' batch size
    slo_models = [m for strategy, m in engine_models if strategy == "slo"]
    assert len(slo_models) == 2 and all(m is model for m in slo_models)  # the same object for every slo run
    results = json.loads((out / "results.json").read_text())
    assert results["startup"]["latency_model_s"] >= 0
    assert results["settings"]["latency_model"].startswith("measured")
    assert LatencyModel.load(out / "latency_model.json") == model
    assert "measuring the slo latency model" in (out / "report.md").read_text()


def test_slo_latency_model_measured_by_profiling_and_goodput_fraction(tmp_path):
    out = tmp_path / "profiled"
    rc = main(FAST + ["--strategies", "slo", "--max-batch-size", "2", "--rate-frac", "0.5", "--timeout-s", "1",
                      "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["startup"]["latency_model_s"] > 0
    LatencyModel.load(out / "latency_model.json")
    capacity = results["capacity"]["rps"]
    summary, run = results["summaries"][0], results["runs"][0]
    assert summary["goodput_frac"]["median"] == pytest.approx(run["goodput_rps"] / capacity)
    assert "| goodput / capacity |" in (out / "report.md").read_text()


# --- what the metrics count ------------------------------------------------------------------------------------------
class DeadlineStub:
    """Answers by seed: 0 OK fast, 1 OK slow (1.5 s: late when it has a deadline), 2 timeout, 3 refused after
    20 ms, 4 other failure."""

    name = "stub"

    async def send(self, spec):
        kind = spec.seed % 5
        if kind == 1:
            await asyncio.sleep(1.5)
        if kind == 2:
            await asyncio.sleep(spec.timeout_s or 0.0)
            return Reply(TIMEOUT, error="deadline passed", reason="timeout")
        if kind == 3:
            await asyncio.sleep(0.02)
            return Reply(REJECTED, error="predicted to miss", reason="deadline_infeasible")
        if kind == 4:
            return Reply(FAILED, error="boom")
        return Reply(OK)


def test_late_ok_deadline_misses_and_refusal_times_are_counted():
    # a deadline of 0.5 s: a fast answer meets it even when a busy machine holds the loop up for a while
    specs = [RequestSpec("p", i, timeout_s=0.5) for i in range(10)]
    specs += [RequestSpec("p", 11)]  # slow, but no deadline: not late
    trace = Trace([TraceItem(0.005 * i, s) for i, s in enumerate(specs)], "stub")
    result = asyncio.run(run_open_loop(DeadlineStub(), trace, warmup_s=0.0, drain_s=5.0))
    m = summarize(result, "stub", 0, 1.0, [], None, 1.0, Usage())
    assert m.late_ok == 2  # seeds 1 and 6: OK, but 1.5 s after a 0.5 s deadline
    assert 800 < m.late_ok_max_over_ms < 10_000
    assert (m.counts.completed, m.counts.deadline_missed, m.counts.rejected, m.counts.failed) == (5, 2, 2, 2)
    assert m.refusal.count == 2 and 20 <= m.refusal.p50_ms <= m.refusal.max_ms < 10_000
    assert m.rejected_reasons == {"deadline_infeasible": 2}
    s = summarize_repeats([m], capacity_rps=2 * m.goodput_rps)
    assert s.late_ok == 2 and s.deadline_missed == 2
    assert s.goodput_frac.median == pytest.approx(0.5)
    assert summarize_repeats([m]).goodput_frac.median is None  # no capacity measured: no fraction


def test_http_504_is_a_deadline_miss_and_429_reasons_are_kept():
    async def handler(request):
        body = await request.json()
        if body["seed"] == 1:
            return web.json_response({"error": {"message": "would miss", "code": "deadline_infeasible"}},
                                     status=429, headers={"Retry-After": "1"})
        return web.json_response({"error": {"message": "too late", "code": "deadline_exceeded"}}, status=504)

    async def run():
        app = web.Application()
        app.router.add_post("/v1/images/generations", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        target = HttpTarget(f"http://127.0.0.1:{port}")
        await target.start()
        try:
            return [await target.send(RequestSpec("p", seed, timeout_s=t)) for seed, t in ((0, 1.0), (1, 1.0),
                                                                                            (2, None))]
        finally:
            await target.stop()
            await runner.cleanup()

    late, refused, no_deadline = asyncio.run(run())
    assert late.status == TIMEOUT and late.reason == "deadline_exceeded"
    assert refused.status == REJECTED and refused.reason == "deadline_infeasible"
    assert no_deadline.status == FAILED  # a 504 for a request without a deadline is a plain failure


# --- flags -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_timeout_s_must_be_positive(value):
    with pytest.raises(UsageError, match=r"--timeout-s: must be a number of seconds > 0"):
        config_from_args(["--model", "fake", f"--timeout-s={value}"])


def test_timeout_flag_errors_are_clear(tmp_path, capsys):
    assert main(["--model", "fake", "--timeout-s", "0"]) == 2
    assert "--timeout-s: must be a number of seconds > 0" in capsys.readouterr().err
    with pytest.raises(UsageError, match="invalid float value"):
        config_from_args(["--timeout-s", "soon"])
    with pytest.raises(UsageError, match="not allowed with"):
        config_from_args(["--timeout-s", "1", "--timeout-slo"])
    model_file = tmp_path / "m.json"
    LatencyModel.from_cost_model(CostModel()).save(model_file)
    with pytest.raises(UsageError, match="goes with the slo strategy"):
        config_from_args(["--strategies", "continuous", "--latency-model", str(model_file)])
    with pytest.raises(UsageError, match="is not a file"):
        config_from_args(["--strategies", "slo", "--latency-model", str(tmp_path / "missing.json")])
    with pytest.raises(UsageError, match="in-process slo contenders"):
        config_from_args(["--target", "http://127.0.0.1:1", "--strategies", "slo", "--latency-model",
                          str(model_file)])


def test_flags_parse_into_the_config(tmp_path):
    cfg = config_from_args(["--model", "fake", "--timeout-s", "2.5"])
    assert cfg.timeout_s == 2.5 and not cfg.timeout_slo and cfg.has_deadlines
    cfg = config_from_args(["--model", "fake", "--timeout-slo", "--slo-x-idle", "3"])
    assert cfg.timeout_s is None and cfg.timeout_slo and cfg.slo_x_idle == 3
    model_file = tmp_path / "m.json"
    LatencyModel.from_cost_model(CostModel()).save(model_file)
    cfg = config_from_args(["--strategies", "slo", "--timeout-slo", "--latency-model", str(model_file)])
    assert cfg.latency_model == str(model_file)


def test_the_default_strategies_are_every_strategy_with_or_without_deadlines():
    for flags in ([], ["--timeout-s", "1"], ["--timeout-slo"]):
        got = {c.strategy for c in config_from_args(["--model", "fake", *flags]).contenders}
        assert got == set(STRATEGIES), flags
    assert [c.strategy for c in config_from_args(["--strategies", "slo"]).contenders] == ["slo"]

