"""IP-Adapters in bench workloads: a mix's `ip_adapter` field gives some requests an image prompt, its picture a
pooled image, drawn from each request's own seed (the trace is otherwise the one without it); traces carry the
columns; the HTTP body carries the picture as a base64 PNG; an in-process run serves image-prompt and plain
requests together and reports them apart."""

import base64
import io
import json

import numpy as np
import pytest
from ip_adapter_reference import build_ip_adapters
from PIL import Image

from stepserve.bench.edits import pool_image
from stepserve.bench.trace_files import load_trace, save_trace
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.commands.bench import UsageError, config_from_args, main

MIX = {"steps": [3, 5], "size": "16x16", "ip_adapter": {"none": 2, "face": 1}}


def test_image_prompts_are_drawn_from_each_requests_seed():
    plain = poisson_trace(Mix.from_dict({k: v for k, v in MIX.items() if k != "ip_adapter"}), 40, 10, seed=3)
    mixed = poisson_trace(Mix.from_dict(MIX), 40, 10, seed=3)
    assert [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in plain.items] == \
        [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in mixed.items]
    names = [i.spec.ip_adapter for i in mixed.items]
    assert 0.2 < names.count("face") / len(names) < 0.5 and set(names) == {None, "face"}
    assert all(i.spec.ip_image is not None for i in mixed.items if i.spec.ip_adapter)
    both = poisson_trace(Mix.from_dict({**MIX, "control": {"none": 1, "edge": 1}}), 40, 10, seed=3)
    assert [i.spec.ip_adapter for i in both.items] == names  # a control beside it changes no image prompt


def test_an_image_prompt_spec_carries_its_picture_in_process_and_over_http():
    spec = next(i.spec for i in poisson_trace(Mix.from_dict(MIX), 40, 10, seed=3).items if i.spec.ip_adapter)
    want = np.asarray(pool_image(spec.ip_image, 16, 16))
    prompt = spec.to_params().ip_adapter
    assert prompt["name"] == "face" and np.array_equal(np.asarray(prompt["image"]), want)
    sent = spec.to_http()["ip_adapter"]
    decoded = Image.open(io.BytesIO(base64.b64decode(sent["image"])))
    assert sent["name"] == "face" and np.array_equal(np.asarray(decoded.convert("RGB")), want)


def test_an_image_prompt_mix_needs_a_size():
    with pytest.raises(ValueError, match="needs `size`"):
        Mix.from_dict({"ip_adapter": ["none", "face"]})


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_traces_round_trip_image_prompts(tmp_path, suffix):
    trace = poisson_trace(Mix.from_dict(MIX), 20, 3, seed=1)
    path = tmp_path / f"t{suffix}"
    save_trace(trace, path)
    assert [i.spec for i in load_trace(path).items] == [i.spec for i in trace.items]


def test_an_in_process_run_serves_image_prompt_and_plain_requests(tmp_path, tiny_sd_path):
    folder = build_ip_adapters(tiny_sd_path, tmp_path / "ip_adapters")
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps(MIX))
    out = tmp_path / "out"
    assert main(["--model", str(tiny_sd_path), "--ip-adapter-dir", str(folder), "--strategies", "continuous",
                 "--mix", str(mix), "--load", "closed", "--users", "4", "--duration", "2", "--warmup", "0.5",
                 "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["counts"]["completed"] > 0 and run["counts"].get("failed", 0) == 0, run["counts"]
    kinds = {k["kind"]: k for k in run["latency_by_kind"]}
    assert set(kinds) == {"generation", "image prompt"} and kinds["image prompt"]["completed"] > 0, kinds
    assert "image prompt" in (out / "report.md").read_text()


def test_ip_adapter_dir_is_for_the_in_process_model():
    with pytest.raises(UsageError, match="--ip-adapter-dir loads into the in-process model"):
        config_from_args(["--target", "http://127.0.0.1:1", "--ip-adapter-dir", "x"])


@pytest.mark.parametrize("field", ["ip_adapter", "control"])
def test_peers_take_no_image_prompts_or_controls(tmp_path, field):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps({"steps": [3], "size": "16x16", field: {"none": 1, "x": 1}}))
    with pytest.raises(UsageError, match=f"text to image only; drop the mix's {field} field"):
        config_from_args(["--peers", "litserve", "--mix", str(mix)])
