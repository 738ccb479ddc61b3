"""Edits in bench workloads: a mix's `edit` and `strength` fields make some requests image-to-image or inpainting
edits of pooled images, drawn from each request's own seed (the trace is otherwise the one without edits); traces
carry edit, strength and image columns; a run on the embedded model reports latency per kind."""

import json

import numpy as np
import pytest

from stepserve.bench.edits import edit_form, pool_image, pool_mask
from stepserve.bench.trace_files import load_trace, save_trace
from stepserve.bench.workload import Mix, poisson_trace
from stepserve.commands.bench import UsageError, config_from_args, main

EDIT_MIX = {"steps": [6, 10], "size": "32x32", "edit": {"none": 2, "image": 1, "inpaint": 1},
            "strength": [0.3, 0.5, 0.8]}


def test_edits_are_drawn_from_each_requests_seed():
    plain = poisson_trace(Mix.from_dict({k: v for k, v in EDIT_MIX.items() if k not in ("edit", "strength")}),
                          20, 10, seed=3)
    edits = poisson_trace(Mix.from_dict(EDIT_MIX), 20, 10, seed=3)
    assert [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in plain.items] == \
        [(i.offset_s, i.spec.seed, i.spec.num_inference_steps) for i in edits.items]
    kinds = [i.spec.edit for i in edits.items]
    assert 0.3 < kinds.count(None) / len(kinds) < 0.7 and "image" in kinds and "inpaint" in kinds
    assert {i.spec.strength for i in edits.items if i.spec.edit} == {0.3, 0.5, 0.8}
    assert all(i.spec.strength is None and i.spec.image is None for i in edits.items if not i.spec.edit)


def test_an_edit_mix_needs_a_size_and_known_kinds():
    with pytest.raises(ValueError, match="needs `size`"):
        Mix.from_dict({"edit": ["none", "image"]})
    with pytest.raises(ValueError, match="allowed: none, image, inpaint"):
        Mix.from_dict({"edit": ["outpaint"], "size": "32x32"})


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_traces_round_trip_edits(tmp_path, suffix):
    trace = poisson_trace(Mix.from_dict(EDIT_MIX), 20, 3, seed=1)
    path = tmp_path / f"t{suffix}"
    save_trace(trace, path)
    assert [i.spec for i in load_trace(path).items] == [i.spec for i in trace.items]


def test_a_trace_row_with_a_bad_edit_names_it(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"offset_s": 0, "prompt": "a seven", "edit": "erase"}) + "\n")
    with pytest.raises(ValueError, match="row 1: edit 'erase'; allowed: none, image, inpaint"):
        load_trace(path)
    path.write_text(json.dumps({"offset_s": 0, "prompt": "a seven", "edit": "image", "strength": 1.5}) + "\n")
    with pytest.raises(ValueError, match="strength must be in"):
        load_trace(path)


def test_the_pool_is_deterministic_and_masks_cover_a_quarter_to_a_half():
    assert np.array_equal(np.asarray(pool_image(4, 48, 32)), np.asarray(pool_image(4, 48, 32)))
    assert not np.array_equal(np.asarray(pool_image(4, 48, 32)), np.asarray(pool_image(5, 48, 32)))
    assert pool_image(4, 48, 32).size == (48, 32)
    for i in range(16):
        share = (np.asarray(pool_mask(i, 40, 40)) > 127).mean()
        assert 0.24 <= share <= 0.51


def test_an_edit_form_carries_the_fields_the_image_and_the_mask():
    spec = poisson_trace(Mix.from_dict({**EDIT_MIX, "edit": "inpaint"}), 20, 1, seed=0).items[0].spec
    fields, files = edit_form(spec)
    assert fields["size"] == "32x32" and json.loads(fields["strength"]) == spec.strength
    assert set(files) == {"image", "mask"} and files["image"].startswith(b"\x89PNG")


def test_a_run_reports_latency_by_kind(tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps(EDIT_MIX))
    out = tmp_path / "out"
    assert main(["--model", "embedded", "--strategies", "continuous", "--mix", str(mix), "--load", "closed",
                 "--users", "4", "--duration", "2", "--warmup", "0.5", "--out", str(out), "--no-progress",
                 "--threads", "1"]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    kinds = {k["kind"]: k for k in run["latency_by_kind"]}
    assert set(kinds) == {"generation", "image", "inpaint"}
    assert all(k["completed"] == k["measured"] > 0 for k in kinds.values())
    assert "## Latency by kind" in (out / "report.md").read_text()


def test_peers_serve_generations_only(tmp_path):
    mix = tmp_path / "mix.json"
    mix.write_text(json.dumps(EDIT_MIX))
    with pytest.raises(UsageError, match="text to image only"):
        config_from_args(["--peers", "litserve", "--mix", str(mix)])
