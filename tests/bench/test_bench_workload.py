"""Mixes and traces: files load, the same seed gives the identical trace."""

import json
import random

import pytest

from stepserve.bench.trace_files import load_trace, save_trace
from stepserve.bench.workload import Mix, RequestSpec, poisson_trace, user_requests


def test_same_seed_same_trace_and_different_seed_differs():
    mix = Mix.from_steps([8, 20, 40])
    a = poisson_trace(mix, 5.0, 20.0, seed=7)
    b = poisson_trace(mix, 5.0, 20.0, seed=7)
    c = poisson_trace(mix, 5.0, 20.0, seed=8)
    assert a == b
    assert a.items != c.items
    assert {it.spec.num_inference_steps for it in a.items} == {8, 20, 40}
    assert all(x.offset_s < y.offset_s for x, y in zip(a.items, a.items[1:]))
    assert 0.7 * 100 < len(a.items) < 1.3 * 100  # ~rate x duration


def test_arrivals_do_not_depend_on_the_mix():
    """Changing the request mix keeps the arrival times (separate seeded streams)."""
    a = poisson_trace(Mix.from_steps([8]), 3.0, 10.0, seed=1)
    b = poisson_trace(Mix.from_steps([8, 40]), 3.0, 10.0, seed=1)
    assert [i.offset_s for i in a.items] == [i.offset_s for i in b.items]


def test_mix_yaml_and_json(tmp_path):
    (tmp_path / "mix.yaml").write_text(
        "steps: {8: 3, 40: 1}\nguidance_scale: [1.0, 3.0]\nsampler: euler\nsize: ['32x32']\nprompts: ['a seven']\n")
    (tmp_path / "mix.json").write_text(json.dumps({"steps": {"8": 3, "40": 1}, "guidance_scale": [1.0, 3.0],
                                                   "sampler": "euler", "size": ["32x32"], "prompts": ["a seven"]}))
    for name in ("mix.yaml", "mix.json"):
        mix = Mix.load(tmp_path / name)
        specs = [mix.draw(random.Random(i)) for i in range(400)]
        assert {s.num_inference_steps for s in specs} == {8, 40}
        share_8 = sum(s.num_inference_steps == 8 for s in specs) / len(specs)
        assert 0.65 < share_8 < 0.85
        assert {s.sampler for s in specs} == {"euler"} and {(s.height, s.width) for s in specs} == {(32, 32)}
        assert mix.heaviest(40).guidance_scale == 3.0 and mix.heaviest(40).num_inference_steps == 40


def test_bad_mix_names_allowed_fields(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps({"stepz": [8]}))
    with pytest.raises(ValueError, match="allowed: steps"):
        Mix.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="WxH"):
        Mix.from_dict({"size": ["big"]})


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_trace_files_round_trip(tmp_path, suffix):
    trace = poisson_trace(Mix.from_dict({"steps": [8, 20], "guidance_scale": [1.0, 3.0], "size": ["32x32"]}),
                          4.0, 5.0, seed=3)
    path = tmp_path / f"trace{suffix}"
    save_trace(trace, path)
    loaded = load_trace(path)
    assert [i.offset_s for i in loaded.items] == pytest.approx([i.offset_s for i in trace.items])
    assert [i.spec for i in loaded.items] == [i.spec for i in trace.items]


def test_hand_written_csv_trace_with_optional_fields(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("offset_s,prompt,num_inference_steps\n0.5,a three,20\n0.0,a one,\n")
    trace = load_trace(path)
    assert [i.offset_s for i in trace.items] == [0.0, 0.5]  # sorted by offset
    assert trace.items[0].spec == RequestSpec(prompt="a one", seed=1)
    assert trace.items[1].spec.num_inference_steps == 20
    path.write_text("offset_s,prompt,colour\n0.5,a three,red\n")
    with pytest.raises(ValueError, match="allowed: offset_s"):
        load_trace(path)


def test_closed_loop_user_sequences_are_seeded():
    mix = Mix.from_steps([8, 20, 40])
    take = lambda gen: [next(gen) for _ in range(10)]  # noqa: E731
    assert take(user_requests(mix, 1, 0)) == take(user_requests(mix, 1, 0))
    assert take(user_requests(mix, 1, 0)) != take(user_requests(mix, 1, 1))


def test_request_spec_to_http_body():
    spec = RequestSpec("a two", 5, num_inference_steps=8, guidance_scale=3.0, sampler="euler", height=32, width=48)
    body = spec.to_http()
    assert body == {"prompt": "a two", "n": 1, "response_format": "b64_json", "seed": 5, "size": "48x32",
                    "num_inference_steps": 8, "guidance_scale": 3.0, "sampler": "euler"}
    assert spec.to_params().height == 32
