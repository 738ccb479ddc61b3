"""Several models on the simulated clock from the command line and the bench's workload: `--latency-model
NAME=FILE` repeated, `--model-weight`, a mix's or trace's `model` field routed to that model's engine."""

import json
import random

import pytest

from stepserve.bench.targets import Contender
from stepserve.bench.trace_files import load_trace, save_trace
from stepserve.bench.workload import Mix, RequestSpec, Trace, TraceItem, poisson_trace
from stepserve.commands.simulate import main
from stepserve.costs import CostModel, LatencyModel
from stepserve.sim.bench import load_models, make_core
from stepserve.sim.device import Models
from stepserve.sim.drive import drive_open

LATENCY = "stepserve/models/latency"


@pytest.fixture
def files(tmp_path):
    fast, slow = tmp_path / "fast.json", tmp_path / "slow.json"
    LatencyModel.from_cost_model(CostModel()).save(fast)
    LatencyModel.from_cost_model(CostModel(step_per_item_s=0.02)).save(slow)
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"steps": 4, "model": {"fast": 1, "slow": 1}}))
    return fast, slow, mix


def test_the_mix_model_field_sends_each_request_to_its_models_engine(files):
    fast, slow, _ = files
    setup = load_models({"fast": fast, "slow": slow}, {"slow": 2.0})
    replica = make_core(setup, Contender("continuous", max_batch_size=4), 0)
    assert isinstance(replica, Models) and replica.share.weight("slow") == 2.0
    mix = Mix.from_dict({"steps": 4, "model": {"fast": 1, "slow": 1}})
    trace = poisson_trace(mix, 20.0, 2.0, seed=1)
    driven = drive_open(replica, trace, 0.0, 1e6)
    assert all(o.reply.status == "ok" for o in driven.outcomes)
    for name in ("fast", "slow"):
        sent = sum(1 for it in trace.items if it.spec.model == name)
        assert 0 < sent < len(trace.items)
        assert sum(replica.cores[name].executor.forward_batch_sizes) == 4 * sent  # 4 steps each, in its engine


def test_a_model_drawn_per_request_leaves_the_rest_of_the_trace_as_it_was():
    plain = poisson_trace(Mix.from_steps([4, 8]), 5.0, 10.0, seed=2)
    named = poisson_trace(Mix.from_dict({"steps": [4, 8], "model": ["a", "b"]}), 5.0, 10.0, seed=2)
    assert [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in plain.items] == \
        [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in named.items]
    assert {i.spec.model for i in named.items} == {"a", "b"} and {i.spec.model for i in plain.items} == {None}


def test_the_live_bench_sends_the_model_in_the_body_and_a_trace_file_keeps_it(tmp_path):
    spec = RequestSpec(prompt="a", seed=1, model="sd15")
    assert spec.to_http()["model"] == "sd15" and "model" not in RequestSpec(prompt="a", seed=1).to_http()
    for suffix in (".jsonl", ".csv"):
        path = tmp_path / f"trace{suffix}"
        save_trace(Trace([TraceItem(0.5, spec), TraceItem(1.0, RequestSpec(prompt="b", seed=2))]), path)
        assert [it.spec.model for it in load_trace(path).items] == ["sd15", None]


def test_simulate_with_two_models_one_replica_and_a_fleet(files, tmp_path, capsys):
    fast, slow, mix = files
    common = ["--latency-model", f"fast={fast}", "--latency-model", f"slow={slow}", "--model-weight", "slow=3",
              "--mix", str(mix), "--rate-frac", "0.6", "--duration", "2", "--warmup", "0.2", "--drain", "1",
              "--capacity-duration", "1", "--strategies", "continuous,slo", "--no-progress", "--seed", "4"]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--replicas", "2", "--out", str(tmp_path / "two")]) == 0
    for out in ("one", "two"):
        results = json.loads((tmp_path / out / "results.json").read_text())
        assert results["settings"]["target"].startswith(f"simulated engine, models fast (latency model {fast}), "
                                                        f"slow (latency model {slow})")
        assert all(run["counts"]["completed"] > 0 for run in results["runs"])


@pytest.mark.parametrize("argv, message", [
    (["--model-weight", "a=2"], "--model-weight goes with several models"),
    (["--latency-model", "a=F", "--latency-model", "PLAIN"], "with several models every one is NAME=FILE"),
    (["--latency-model", "a=F", "--model-weight", "b=1"], "--model-weight: no model 'b'; the models: a"),
    (["--latency-model", "a=F", "--model-weight", "a=0"], "the weight must be a positive number, got '0'"),
    (["--latency-model", "a=F", "--latency-model", "a=G"], "model 'a' is given twice"),
    (["--latency-model", "=F"], "--latency-model: expected NAME=FILE"),
])
def test_bad_model_flags_fail_with_one_line(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stepserve simulate: ") and message in err and "\n" not in err


def test_a_request_for_a_model_not_given_fails_with_one_line_naming_the_models(files, tmp_path, capsys):
    fast, slow, _ = files
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"steps": 4, "model": ["fast", "other"]}))
    assert main(["--latency-model", f"fast={fast}", "--latency-model", f"slow={slow}", "--mix", str(bad),
                 "--rate-frac", "0.5", "--duration", "1", "--capacity-duration", "1", "--strategies", "continuous",
                 "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "names model 'other', which this replica does not hold; it holds: fast, slow" in err and "\n" not in err
