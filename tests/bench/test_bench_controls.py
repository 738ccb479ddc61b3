"""ControlNets in bench workloads: a mix's `control` field gives some requests a ControlNet, its map a pooled image,
drawn from each request's own seed (the trace is otherwise the one without it); traces carry the column; the HTTP
body carries the map as a base64 PNG; an in-process run serves controlled and plain requests together."""

import base64
import io
import json

import numpy as np
import pytest
from control_reference import build_controlnets
from PIL import Image

from stepserve.bench.edits import pool_image
from stepserve.bench.trace_files import load_trace, save_trace
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.commands.bench import UsageError, config_from_args, main

MIX = {"steps": [3, 5], "size": "16x16", "control": {"none": 7, "edge": 3}}


def test_controls_are_drawn_from_each_requests_seed():
    plain = poisson_trace(Mix.from_dict({k: v for k, v in MIX.items() if k != "control"}), 40, 10, seed=3)
    mixed = poisson_trace(Mix.from_dict(MIX), 40, 10, seed=3)
    assert [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in plain.items] == \
        [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in mixed.items]
    names = [i.spec.control for i in mixed.items]
    assert 0.15 < names.count("edge") / len(names) < 0.45 and set(names) == {None, "edge"}
    assert all(i.spec.image is not None for i in mixed.items if i.spec.control)


def test_a_controlled_spec_carries_its_map_in_process_and_over_http():
    spec = next(i.spec for i in poisson_trace(Mix.from_dict(MIX), 40, 10, seed=3).items if i.spec.control)
    want = np.asarray(pool_image(spec.image, 16, 16))
    [control] = spec.to_params().controls
    assert control["name"] == "edge" and np.array_equal(np.asarray(control["image"]), want)
    [sent] = spec.to_http()["controls"]
    decoded = Image.open(io.BytesIO(base64.b64decode(sent["image"])))
    assert sent["name"] == "edge" and np.array_equal(np.asarray(decoded.convert("RGB")), want)


def test_a_control_mix_needs_a_size():
    with pytest.raises(ValueError, match="needs `size`"):
        Mix.from_dict({"control": ["none", "edge"]})


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_traces_round_trip_controls(tmp_path, suffix):
    trace = poisson_trace(Mix.from_dict(MIX), 20, 3, seed=1)
    path = tmp_path / f"t{suffix}"
    save_trace(trace, path)
    assert [i.spec for i in load_trace(path).items] == [i.spec for i in trace.items]


def test_an_in_process_run_serves_controlled_and_plain_requests(tmp_path, tiny_sd_path):
    folder = build_controlnets(tiny_sd_path, tmp_path / "controlnets")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps(MIX))
    out = tmp_path / "out"
    assert main(["--model", str(tiny_sd_path), "--controlnet-dir", str(folder), "--strategies", "continuous",
                 "--mix", str(mix), "--load", "closed", "--users", "4", "--duration", "2", "--warmup", "0.5",
                 "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["counts"]["completed"] > 0 and run["counts"].get("failed", 0) == 0, run["counts"]
    kinds = {k["kind"]: k for k in run["latency_by_kind"]}
    assert set(kinds) == {"generation", "controlled"} and kinds["controlled"]["completed"] > 0, kinds
    assert "controlled" in (out / "report.md").read_text()


def test_controlnet_dir_is_for_the_in_process_model():
    with pytest.raises(UsageError, match="--controlnet-dir loads into the in-process model"):
        config_from_args(["--target", "http://127.0.0.1:1", "--controlnet-dir", "x"])
