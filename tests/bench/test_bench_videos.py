"""Video requests in bench workloads: a mix's `frames` field gives each request a frame count drawn from its own
seed (the trace is otherwise the one without it), traces carry num_frames, such a mix runs in process only, and
an in-process run on a tiny Wan serves videos of those frames."""

import json

import pytest

from stepserve.bench.trace_files import load_trace, save_trace
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.commands.bench import UsageError, config_from_args

MIX = {"steps": [2, 3], "size": "32x32", "frames": [1, 5]}


def test_frames_are_drawn_from_each_requests_seed():
    plain = poisson_trace(Mix.from_dict({"steps": [2, 3], "size": "32x32"}), 20, 10, seed=3)
    videos = poisson_trace(Mix.from_dict(MIX), 20, 10, seed=3)
    assert [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in plain.items] == \
        [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in videos.items]
    assert {i.spec.num_frames for i in videos.items} == {1, 5}
    assert all(i.spec.to_params().num_frames == i.spec.num_frames for i in videos.items)
    assert Mix.from_dict(MIX).heaviest(3).num_frames == 5


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_traces_round_trip_frames(tmp_path, suffix):
    trace = poisson_trace(Mix.from_dict(MIX), 20, 3, seed=1)
    path = tmp_path / f"t{suffix}"
    save_trace(trace, path)
    assert [i.spec for i in load_trace(path).items] == [i.spec for i in trace.items]


def test_bad_frames_and_http_targets_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mix field 'frames'.*whole numbers >= 1"):
        Mix.from_dict({"frames": [0]})
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps(MIX))
    for flags in (["--target", "http://127.0.0.1:9"], ["--peers", "litserve"]):
        with pytest.raises(UsageError, match="runs in process"):
            config_from_args([*flags, "--mix", str(mix)])
    with pytest.raises(ValueError, match="runs in process only"):
        poisson_trace(Mix.from_dict(MIX), 20, 3, seed=1).items[0].spec.to_http()
