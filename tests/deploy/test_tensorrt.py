"""`stepserve export tensorrt` against real ONNX exports, as it runs without TensorRT and a GPU: the trtexec
commands and build script, the engine folder's layout, bad input, and the TensorRT loader's errors."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

from stepserve.backends.tensorrt import TensorRTUnavailableError, load_tensorrt_networks
from stepserve.commands import export_tensorrt as cli
from stepserve.deploy.tensorrt_build import missing_requirements
from stepserve.deploy.tensorrt_plan import SCRIPT_FILE, read_onnx_export
from stepserve.deploy.tensorrt_profiles import InputSpec, SizeRange

CAN_BUILD_HERE = not missing_requirements()


# --- the command against real ONNX exports ---------------------------------------------------------------------
def run_cli(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


needs_no_tensorrt = pytest.mark.skipif(CAN_BUILD_HERE, reason="this machine can build engines; tested elsewhere")


@needs_no_tensorrt
def test_without_tensorrt_the_command_writes_trtexec_lines_and_says_what_is_missing(embedded_onnx, tmp_path, capsys):
    out = tmp_path / "engines"
    rc, _, err = run_cli(["--onnx", embedded_onnx, "--out", out, "--max-batch-size", "4"], capsys)
    assert rc == 0
    assert "cannot build TensorRT engines here" in err and "build_engines.sh" in err
    for what in missing_requirements():
        assert what in err
    assert "the `tensorrt` Python package" in err or "a CUDA GPU" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "stepserve-tensorrt" and manifest["built"] is False
    assert manifest["missing"] == missing_requirements()
    assert manifest["source"]["name"] == "embedded"
    onnx, eng = embedded_onnx.resolve(), out.resolve()
    # the embedded model: 16 tokens of 64, 4 latent channels, 32x32 pixels only = 8x8 latents
    assert manifest["networks"]["unet"]["trtexec"] == [
        "trtexec", f"--onnx={onnx}/unet.onnx", f"--saveEngine={eng}/unet.plan",
        "--minShapes=sample:1x4x8x8,timestep:1,encoder_hidden_states:1x16x64",
        "--optShapes=sample:8x4x8x8,timestep:8,encoder_hidden_states:8x16x64",
        "--maxShapes=sample:8x4x8x8,timestep:8,encoder_hidden_states:8x16x64",
        "--memPoolSize=workspace:4096M"]
    assert manifest["networks"]["text_encoder"]["trtexec"][3:6] == [
        "--minShapes=input_ids:1x16", "--optShapes=input_ids:8x16", "--maxShapes=input_ids:8x16"]
    assert manifest["networks"]["vae_decoder"]["trtexec"][3:6] == [
        "--minShapes=latent_sample:1x4x8x8", "--optShapes=latent_sample:4x4x8x8", "--maxShapes=latent_sample:4x4x8x8"]
    script = out / SCRIPT_FILE
    assert script.stat().st_mode & stat.S_IXUSR
    assert "--fp16" not in script.read_text()
    assert not list(out.glob("*.plan")) and not list(out.glob("*.onnx"))


def test_the_script_runs_the_same_trtexec_commands_as_the_manifest(embedded_onnx, tmp_path, capsys):
    out = tmp_path / "engines"
    rc, _, _ = run_cli(["--onnx", embedded_onnx, "--out", out, "--buckets", "1,2,4,8", "--max-batch-size", "6",
                        "--fp16", "--workspace-mib", "1024", "--script-only"], capsys)
    assert rc == 0
    record = tmp_path / "calls.jsonl"
    fake = tmp_path / "fake_trtexec"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    moved = tmp_path / "moved"
    out.rename(moved)  # the folder may be copied to the serving machine: OUT_DIR follows the script
    env = dict(os.environ, TRTEXEC=str(fake))
    subprocess.run(["bash", str(moved / SCRIPT_FILE)], check=True, env=env, capture_output=True)
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    manifest = json.loads((moved / "manifest.json").read_text())
    want = [[a.replace(str(out.resolve()), str(moved.resolve())) for a in manifest["networks"][n]["trtexec"][1:]]
            for n in ("text_encoder", "unet", "vae_decoder")]
    assert calls == want
    unet = calls[1]
    assert "--maxShapes=sample:16x4x8x8,timestep:16,encoder_hidden_states:16x16x64" in unet  # bucket 8, guided
    assert "--optShapes=sample:16x4x8x8,timestep:16,encoder_hidden_states:16x16x64" in unet
    assert all(c[-2:] == ["--memPoolSize=workspace:1024M", "--fp16"] for c in calls)
    assert manifest["settings"]["opt_batch"] == 8 and manifest["settings"]["buckets"] == [1, 2, 4, 8]


def test_every_profile_corner_is_a_shape_the_onnx_graph_runs(ort, tiny_onnx, tmp_path, capsys):
    """min and max of each profile of a model with a size range (tiny: 8..32 pixels, latents 4..16) run in
    onnxruntime, so the profiles hold no shape the graphs cannot take."""
    out = tmp_path / "engines"
    assert run_cli(["--onnx", tiny_onnx, "--out", out, "--max-batch-size", "2", "--script-only"], capsys)[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sizes"] == {"min_size": 8, "max_size": 32, "default_height": 16, "default_width": 16,
                                 "vae_scale": 2}
    assert manifest["networks"]["unet"]["profiles"][0]["sample"] == {
        "min": [1, 4, 4, 4], "opt": [4, 4, 8, 8], "max": [4, 4, 16, 16]}
    rng = np.random.default_rng(0)
    for net in manifest["networks"].values():
        session = ort.InferenceSession(str(tiny_onnx / net["onnx"]), providers=["CPUExecutionProvider"])
        for corner in ("min", "max"):
            feeds = {}
            for tensor, shapes in net["profiles"][0].items():
                shape = shapes[corner]
                feeds[tensor] = (rng.integers(0, 50, shape).astype(np.int64) if tensor == "input_ids"
                                 else rng.standard_normal(shape).astype(np.float32))
            result = session.run(None, feeds)[0]
            assert result.shape[0] == next(iter(feeds.values())).shape[0]


def test_the_engine_folder_is_read_like_an_export_folder(embedded_onnx, tmp_path, capsys):
    from stepserve.backends.onnxruntime import OnnxRuntimeNetworks
    from stepserve.pipelines.diffusers_sd import StableDiffusionAdapter

    out = tmp_path / "engines"
    assert run_cli(["--onnx", embedded_onnx, "--out", out, "--script-only"], capsys)[0] == 0
    for rel in ("tokenizer", "scheduler/scheduler_config.json", "unet/config.json", "vae/config.json",
                "text_encoder/config.json", "stepserve.json", "model_index.json"):
        assert (out / rel).exists(), rel
    networks = OnnxRuntimeNetworks.from_dir(embedded_onnx, threads=1)  # standing in for the engines
    adapter = StableDiffusionAdapter.from_export_dir(out, networks, "tensorrt")
    assert adapter.info.name == "embedded" and (adapter.info.min_size, adapter.info.max_size) == (32, 32)
    assert adapter.encode_prompts(["3"])[0].shape == (16, 64)


def test_a_second_run_replaces_engines_of_the_first_and_require_build_exits_3(embedded_onnx, tmp_path, capsys):
    out = tmp_path / "engines"
    assert run_cli(["--onnx", embedded_onnx, "--out", out, "--script-only"], capsys)[0] == 0
    (out / "unet.plan").write_bytes(b"an engine for other profiles")
    rc, _, err = run_cli(["--onnx", embedded_onnx, "--out", out, "--script-only", "--require-build"], capsys)
    assert rc == cli.EXIT_NOT_BUILT == 3
    assert "removed engines of an earlier run: unet.plan" in err and not (out / "unet.plan").exists()


@pytest.mark.parametrize("case, words", [
    ("no_manifest", "no manifest.json; make one with `stepserve export onnx`"),
    ("no_folder", "no such folder"),
    ("busy_out", "is not empty and is not an engine folder"),
    ("out_is_onnx", "is the ONNX folder"),
    ("bad_opt", "opt_batch: 3 is not one of the buckets 1,2,4,8"),
    ("bad_workspace", "--workspace-mib 0: must be >= 1"),
])
def test_bad_input_is_one_clear_line_and_exit_2(case, words, embedded_onnx, tmp_path, capsys):
    onnx, out, extra = embedded_onnx, tmp_path / "engines", []
    if case == "no_manifest":
        onnx = tmp_path / "empty"
        onnx.mkdir()
    elif case == "no_folder":
        onnx = tmp_path / "nowhere"
    elif case == "busy_out":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "out_is_onnx":
        out = embedded_onnx
    elif case == "bad_opt":
        extra = ["--buckets", "1,2,4,8", "--max-batch-size", "6", "--opt-batch", "3"]
    else:
        extra = ["--workspace-mib", "0"]
    rc, _, err = run_cli(["--onnx", onnx, "--out", out, *extra], capsys)
    assert rc == 2
    assert words in err and err.startswith("stepserve export tensorrt: ") and err.count("\n") == 1
    if case == "busy_out":
        assert (out / "notes.txt").read_text() == "mine"


def test_bucket_list_syntax_is_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--onnx", "x", "--out", "y", "--buckets", "1,two"])
    assert e.value.code == 2 and "comma-separated list of batch sizes" in capsys.readouterr().err
    assert cli.parse_buckets("1, 2,4,8") == (1, 2, 4, 8)


def test_read_onnx_export_reads_inputs_from_the_manifest(embedded_onnx):
    export = read_onnx_export(embedded_onnx)
    assert export.inputs["unet"][0] == InputSpec("sample", "float", ("batch", 4, "latent_height", "latent_width"))
    assert export.sizes == SizeRange(32, 32, 32, 32, 4)


# --- the backend -----------------------------------------------------------------------------------------------
def test_loading_needs_an_engine_folder(tmp_path, embedded_onnx):
    with pytest.raises(TensorRTUnavailableError, match="no manifest.json, so not an engine folder.*stepserve export "
                                                       "tensorrt"):
        load_tensorrt_networks(tmp_path)
    with pytest.raises(TensorRTUnavailableError, match="is an ONNX export, not an engine folder"):
        load_tensorrt_networks(embedded_onnx)
    with pytest.raises(ValueError, match="device: 'cpu' is not allowed for TensorRT engines"):
        load_tensorrt_networks(tmp_path, "cpu")


@needs_no_tensorrt
def test_loading_without_tensorrt_or_engines_names_everything_missing(embedded_onnx, tmp_path, capsys):
    out = tmp_path / "engines"
    assert run_cli(["--onnx", embedded_onnx, "--out", out], capsys)[0] == 0
    with pytest.raises(TensorRTUnavailableError) as e:
        load_tensorrt_networks(out, "cuda")
    message = str(e.value)
    assert "engine files text_encoder.plan, unet.plan, vae_decoder.plan" in message
    assert "build_engines.sh" in message and "stepserve export tensorrt" in message
    if not torch.cuda.is_available():
        assert "a CUDA device" in message
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        assert "the `tensorrt` Python package" in message
