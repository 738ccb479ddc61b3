"""A latency model says the parallel degree it was measured (or derived) at: `stepserve profile` records the degree
it ran at, and a one-device model becomes a degree-N one by scaling its steps (stepserve.costs.degree)."""

from __future__ import annotations

import os

import pytest

from stepserve.commands import profile as cli
from stepserve.costs import LatencyModel
from stepserve.costs.degree import at_degree, degree_label, devices_of, parallel_entry
from stepserve.costs.latency_model import Curve


def one_device() -> LatencyModel:
    return LatencyModel(step={(64, 64): Curve(((1, 0.2), (2, 0.4)))}, encode=Curve(((1, 0.01),)),
                        decode={(64, 64): Curve(((1, 0.05),))},
                        metadata={"by_guidance_rows": {"1": {"step": [{"bucket": [64, 64],
                                                                      "points": [[1, 0.1], [2, 0.2]]}]}}})


@pytest.mark.parametrize("argv, devices, label", [
    ([], 1, "1 device"),
    (["--ulysses-degree", "2"], 2, "ulysses 2"),
    (["--ulysses-degree", "2", "--cfg-parallel"], 4, "ulysses 2 + cfg"),
    (["--tensor-parallel-size", "4"], 4, "tensor 4"),
])
def test_profile_records_the_degree_it_ran_at(argv, devices, label, tmp_path):
    args = cli.build_parser().parse_args(["--model", "tiny", "--out", str(tmp_path / "l.json"), *argv])
    meta = cli.run_metadata(args)
    m = LatencyModel(step={(8, 8): Curve(((1, 1.0),))}, encode=Curve(((1, 0.0),)),
                     decode={(8, 8): Curve(((1, 0.0),))}, metadata=meta)
    m = LatencyModel.from_json(m.to_json())  # survives the file
    assert meta["parallel"]["devices"] == devices == devices_of(m)
    assert degree_label(m) == label
    assert (cli.parallel_note(args) == "") == (devices == 1)


def test_a_model_without_the_entry_holds_one_device_and_a_bad_entry_is_named():
    assert devices_of(one_device()) == 1
    bad = LatencyModel(step={(8, 8): Curve(((1, 1.0),))}, encode=Curve(((1, 0.0),)),
                       decode={(8, 8): Curve(((1, 0.0),))}, metadata={"parallel": {"devices": 0}})
    with pytest.raises(ValueError, match="'parallel'.*'devices' \\(an integer >= 1\\)"):
        devices_of(bad)


def test_at_degree_scales_the_steps_only_and_says_so():
    base = one_device()
    m = at_degree(base, 0.6, parallel_entry(ulysses=2), figures=["a figure"], assumptions=["an assumption"])
    assert devices_of(m) == 2 and degree_label(m) == "ulysses 2"
    assert m.step_s(1) == pytest.approx(0.12) and m.step_s(2) == pytest.approx(0.24)
    assert m.encode_s(1) == base.encode_s(1) and m.decode_s(1) == base.decode_s(1)  # not split
    assert m.metadata["by_guidance_rows"]["1"]["step"][0]["points"] == [[1, 0.06], [2, 0.12]]
    assert base.metadata["by_guidance_rows"]["1"]["step"][0]["points"] == [[1, 0.1], [2, 0.2]]  # untouched
    assert m.metadata["figures"] == ["a figure"] and m.metadata["assumptions"] == ["an assumption"]
    with pytest.raises(ValueError, match="one-device model"):
        at_degree(m, 0.5, parallel_entry(ulysses=4))


@pytest.mark.slow
def test_profile_at_ulysses_2_measures_the_split_engine_and_says_so(tmp_path, capsys):
    """The tiny Flux.1 profiled with --ulysses-degree 2 (two gloo ranks of one thread): the file holds 2 devices."""
    from stepserve.tiny.flux import build_tiny_flux

    model = build_tiny_flux(tmp_path / "flux")
    out = tmp_path / "latency-u2.json"
    argv = ["--model", str(model), "--threads", "1", "--ulysses-degree", "2", "--max-batch-size", "2",
            "--rounds", "1", "--repeats", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    m = LatencyModel.load(out)
    assert devices_of(m) == 2 and m.metadata["parallel"]["ulysses"] == 2 and m.step_s(1) > 0
    assert "--ulysses-degree 2 (2 devices)" in capsys.readouterr().err
    import subprocess

    mine = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "rank_worker"], capture_output=True, text=True)
    assert mine.stdout == ""  # its worker ranks stopped when it was done, not at the end of this process
