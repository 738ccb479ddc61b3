"""`stepserve profile`: writes a loadable latency model with both guidance measurements and its metadata; bad
flags exit 2 with one clear line."""

from __future__ import annotations

import pytest

from stepserve.cli import COMMANDS
from stepserve.costs import FakeExecutor
from stepserve.costs.guidance import by_guidance_rows
from stepserve.costs.latency_model import LatencyModel
from stepserve.commands import profile as cli


def test_profile_of_the_tiny_pipeline_writes_a_loadable_model_with_metadata(tiny_sd_path, tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    out = tmp_path / "latency.json"
    try:
        rc = cli.main(["--model", str(tiny_sd_path), "--repeats", "1", "--max-batch-size", "2", "--threads", "1",
                       "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    err = capsys.readouterr().err
    assert "with guidance rows" in err and "without guidance" in err and "wrote" in err
    assert "backend torch, 1 thread) ..." in err  # not "1 threads"
    assert "measurements in " in err and " measurement)" not in err  # the progress lines count in plural words
    model = LatencyModel.load(out)
    meta = model.metadata
    assert meta["backend"] == "torch" and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert meta["threads"] == 1 and meta["repeats"] == 1 and meta["batch_sizes"] == [1, 2]
    assert meta["versions"]["torch"] == torch.__version__ and "stepserve" in meta["versions"]
    assert meta["machine"]["cores"] >= 1 and meta["machine"]["processor"]
    assert meta["load_s"] > 0  # a replica's start-up, as `simulate --autoscale` models it
    assert meta["guidance_rows"] == 2  # the tiny pipeline's default guidance is > 1
    bucket = model.reference_bucket
    assert [n for n, _ in model.step[bucket].points] == [1, 2]
    for n, lo, hi in meta["spread"]["step"][0]["points"]:
        assert lo <= hi
    curves = by_guidance_rows(model)
    assert set(curves) == {1, 2}
    assert curves[2].step[bucket] == model.step[bucket] and curves[2].encode == model.encode
    assert all(s > 0 for _, s in curves[1].step[bucket].points)
    assert meta["by_guidance_rows"]["1"]["guidance_scale"] == 1.0
    assert meta["by_guidance_rows"]["2"]["guidance_scale"] > 1
    # what the simulator charges for a guided batch is the model's own curve
    ex = FakeExecutor.charging(model)
    assert ex.cost.seconds("step", 2, 2, bucket) == pytest.approx(model.step_s(2, bucket))
    assert ex.cost.seconds("step", 2, 0, bucket) == pytest.approx(curves[1].step[bucket](2))




@pytest.mark.parametrize("argv, message", [
    (["--backend", "tensorflow"], ("invalid choice: 'tensorflow'", "torch", "onnxruntime", "tensorrt")),
    (["--device", "tpu"], ("invalid choice: 'tpu'", "cpu", "cuda")),
    (["--dtype", "int8"], ("invalid choice: 'int8'", "float32", "float16", "bfloat16")),
    (["--max-batch-size", "0"], "expected an integer >= 1, got '0'"),
    (["--repeats", "x"], "expected an integer >= 1, got 'x'"),
    (["--threads", "-2"], "expected an integer >= 1"),
    (["--sizes", "32by32"], "expected WIDTHxHEIGHT"),
    (["--sizes", "32x32,32x32"], "each size once"),
    (["--guidance-scale", "1"], "expected a number > 1"),
    ([], "the following arguments are required: --out"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, capsys, tmp_path):
    if argv:
        argv = argv + ["--out", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("stepserve profile: error:") and err.count("\n") == 1
    for part in (message,) if isinstance(message, str) else message:
        assert part in err, err


def test_bad_paths_exit_2_before_loading_anything(tmp_path, capsys):
    assert cli.main(["--out", str(tmp_path / "missing" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["--model", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    assert "neither 'embedded' nor a local diffusers folder" in capsys.readouterr().err


def test_a_size_the_model_refuses_exits_2(tiny_sd_path, tmp_path, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        rc = cli.main(["--model", str(tiny_sd_path), "--sizes", "33x33", "--repeats", "1", "--max-batch-size", "1",
                       "--threads", "1", "--out", str(tmp_path / "x.json")])
    finally:
        torch.set_num_threads(threads)
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("stepserve profile: error:") and "height" in err
    assert not (tmp_path / "x.json").exists()


def test_choices_are_the_loaders_and_the_command_is_registered():
    from stepserve.engine.loading import BACKENDS, DEVICES, DTYPES

    actions = {a.dest: a for a in cli.build_parser()._actions}
    assert tuple(actions["backend"].choices) == BACKENDS
    assert tuple(actions["device"].choices) == DEVICES and tuple(actions["dtype"].choices) == DTYPES
    assert COMMANDS["profile"][0] == "stepserve.commands.profile"


def test_sizes_are_width_by_height_as_everywhere_else():
    args = cli.build_parser().parse_args(["--sizes", "64x48,32x32", "--out", "x.json"])
    assert args.sizes == [(48, 64), (32, 32)]  # (height, width) shape buckets from WIDTHxHEIGHT
