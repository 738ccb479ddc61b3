"""Per-request SLOs in traces: the columns width, height, steps (for num_inference_steps) and slo_ms load, save
and round-trip; a request's slo_ms is its deadline (it wins over a run-wide one) and the SLO its attainment and
goodput are judged against; the report says so; live (fake model) and simulated runs both honour it."""

import json
from pathlib import Path

import pytest

from stepserve.bench.load import LoadResult, Outcome
from stepserve.bench.metrics import Usage, slo_attainment, summarize, window_rates
from stepserve.bench.targets import OK, REJECTED, Reply
from stepserve.bench.trace_files import load_trace, save_trace
from stepserve.bench.workload import RequestSpec, Trace, TraceItem
from stepserve.cli import main as stepserve_main
from stepserve.commands.bench import main as bench_main

SAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "dit_trace_sample.jsonl"
LATENCY = Path(__file__).resolve().parents[2] / "stepserve" / "models" / "latency" / "embedded-cpu.json"


def _write(tmp_path, rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_sample_trace_loads_with_steps_sizes_and_per_request_slos():
    trace = load_trace(SAMPLE)
    assert len(trace.items) == 20
    specs = [it.spec for it in trace.items]
    assert {(s.width, s.height) for s in specs} == {(32, 32)}
    assert {s.num_inference_steps for s in specs} <= {8, 15, 20, 40}
    own = [s for s in specs if s.slo_ms is not None]
    assert len(own) == trace.own_slos == 16
    assert all(s.timeout_s == pytest.approx(s.slo_ms / 1000) for s in own)
    assert all(s.timeout_s is None for s in specs if s.slo_ms is None)


def test_steps_is_an_alias_and_a_disagreement_is_refused(tmp_path):
    base = {"offset_s": 0.0, "prompt": "a seven"}
    assert load_trace(_write(tmp_path, [{**base, "steps": 12}])).items[0].spec.num_inference_steps == 12
    same = load_trace(_write(tmp_path, [{**base, "steps": 12, "num_inference_steps": 12}]))
    assert same.items[0].spec.num_inference_steps == 12
    with pytest.raises(ValueError, match="steps 12 and num_inference_steps 20 disagree"):
        load_trace(_write(tmp_path, [{**base, "steps": 12, "num_inference_steps": 20}]))
    with pytest.raises(ValueError, match="unknown field.*allowed: .*slo_ms.*steps"):
        load_trace(_write(tmp_path, [{**base, "stpes": 12}]))


@pytest.mark.parametrize("bad", [0, -5, "nan", "soon"])
def test_slo_ms_must_be_a_positive_number(tmp_path, bad):
    with pytest.raises(ValueError):
        load_trace(_write(tmp_path, [{"offset_s": 0.0, "prompt": "a seven", "slo_ms": bad}]))


def test_a_row_with_both_a_timeout_and_an_slo_keeps_both(tmp_path):
    row = {"offset_s": 0.0, "prompt": "p", "slo_ms": 800, "timeout_s": 1.5}
    spec = load_trace(_write(tmp_path, [row])).items[0].spec
    assert (spec.slo_ms, spec.timeout_s) == (800.0, 1.5)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_save_trace_round_trips_the_per_request_slo(tmp_path, suffix):
    trace = Trace([TraceItem(0.1, RequestSpec("a seven", 1, num_inference_steps=8, height=32, width=32,
                                              timeout_s=0.3, slo_ms=300.0)),
                   TraceItem(0.2, RequestSpec("a three", 2, num_inference_steps=40))])
    path = tmp_path / f"t{suffix}"
    save_trace(trace, path)
    assert [it.spec for it in load_trace(path).items] == [it.spec for it in trace.items]
    again = tmp_path / f"again{suffix}"
    save_trace(load_trace(path), again)
    assert load_trace(again).items == load_trace(path).items


def test_a_per_request_slo_wins_over_the_run_wide_deadline():
    trace = Trace([TraceItem(0.0, RequestSpec("p", 0, timeout_s=0.3, slo_ms=300.0)),
                   TraceItem(0.1, RequestSpec("p", 1)), TraceItem(0.2, RequestSpec("p", 2, timeout_s=9.0))])
    got = trace.with_timeout(2.0)
    assert [it.spec.timeout_s for it in got.items] == [0.3, 2.0, 2.0]
    assert "without its own slo_ms" in got.description
    assert trace.with_timeout(None) is trace


def _outcome(i, latency, slo_ms=None, status=OK, scheduled=1.0):
    spec = RequestSpec("p", i, slo_ms=slo_ms, timeout_s=None if slo_ms is None else slo_ms / 1000)
    done = None if latency is None else scheduled + latency
    return Outcome(i, spec, scheduled, sent_s=scheduled, done_s=done, reply=Reply(status))


def test_attainment_and_goodput_judge_each_request_against_its_own_slo():
    outs = [_outcome(0, 0.5, slo_ms=400),  # own SLO 0.4 s: missed, though within the run's 1 s
            _outcome(1, 1.5, slo_ms=2000),  # own SLO 2 s: met, though over the run's 1 s
            _outcome(2, 0.8),  # the run's 1 s: met
            _outcome(3, 1.2),  # the run's 1 s: missed
            _outcome(4, None, slo_ms=5000, status=REJECTED)]  # never answered: a miss
    assert slo_attainment(outs, 1.0) == pytest.approx(2 / 5)
    assert slo_attainment(outs, None) == pytest.approx(1 / 3)  # no run SLO: only requests with their own
    assert slo_attainment([_outcome(0, 0.5)], None) is None
    result = LoadResult(outs, start=0.0, window_start_s=0.0, window_end_s=4.0, mode="open-loop", description="t")
    assert window_rates(result, 1.0).goodput_rps == pytest.approx(2 / 4.0)
    metrics = summarize(result, "c", 0, 1.0, [], None, 4.0, Usage())
    assert metrics.slo_attainment == pytest.approx(2 / 5) and metrics.own_slo == 3


def test_simulated_run_of_the_sample_reports_attainment_over_per_request_slos(tmp_path):
    out = tmp_path / "sim"
    assert stepserve_main(["simulate", "--latency-model", str(LATENCY), "--load", "trace", "--trace", str(SAMPLE),
                           "--steps", "8,15,20,40", "--strategies", "continuous,slo", "--warmup", "0",
                           "--timeout-s", "5", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["own_slo_requests"] == 16 and results["settings"]["timeout_s"] == 5
    for run in results["runs"]:
        assert run["own_slo"] == 16 and run["late_ok"] == 0 and run["slo_attainment"] is not None
    report = (out / "report.md").read_text()
    assert "over per-request SLOs" in report and "SLO attainment (per-request SLOs)" in report
    assert "every request without its own slo_ms carries timeout_s = 5000 ms" in report
    replayed = load_trace(out / "trace.jsonl")  # the trace written back keeps each request's own SLO
    assert [it.spec.timeout_s for it in replayed.items] == [
        5.0 if it.spec.slo_ms is None else it.spec.slo_ms / 1000 for it in load_trace(SAMPLE).items]


def test_live_run_gives_each_request_its_own_slo_as_its_deadline(tmp_path, submitted):
    trace = _write(tmp_path, [{"offset_s": 0.0, "prompt": "p", "steps": 2, "slo_ms": 900, "seed": 1},
                              {"offset_s": 0.05, "prompt": "p", "steps": 4, "seed": 2},
                              {"offset_s": 0.1, "prompt": "p", "steps": 2, "slo_ms": 1200, "seed": 3}])
    out = tmp_path / "live"
    assert bench_main(["--model", "fake", "--load", "trace", "--trace", str(trace), "--steps", "2,4",
                       "--strategies", "continuous", "--warmup", "0", "--drain", "2", "--timeout-s", "3",
                       "--no-progress", "--seed", "3", "--out", str(out)]) == 0
    by_seed = {p.seed: p.timeout_s for p in submitted if p.seed in (1, 2, 3) and p.timeout_s != 3600.0}
    assert by_seed == {1: 0.9, 2: 3.0, 3: 1.2}
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["own_slo_requests"] == 2 and results["runs"][0]["own_slo"] == 2
    assert "over per-request SLOs" in (out / "report.md").read_text()
