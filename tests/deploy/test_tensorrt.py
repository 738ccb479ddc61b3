"""`stepserve export tensorrt` and the TensorRT backend, as far as they run without TensorRT and a GPU: the
optimization profiles from the serving settings, the trtexec commands and build script written against real ONNX
exports, the engine folder's layout, the loader's errors, and the engine runner's binding logic on a stand-in
engine."""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch
from extras import require
from hypothesis import given, settings
from hypothesis import strategies as st

from stepserve.backends.tensorrt import (
    EngineRunner,
    TensorRTNetworks,
    TensorRTUnavailableError,
    load_tensorrt_networks,
)
from stepserve.deploy import tensorrt as cli
from stepserve.deploy.tensorrt_build import missing_requirements
from stepserve.deploy.tensorrt_plan import SCRIPT_FILE, read_onnx_export
from stepserve.deploy.tensorrt_profiles import (
    InputSpec,
    ServingSettings,
    SizeRange,
    TensorProfile,
    network_profiles,
)

SD_INPUTS = {  # as `stepserve export onnx` states them for an SD 1.x model
    "text_encoder": (InputSpec("input_ids", "int64", ("batch", 77)),),
    "unet": (InputSpec("sample", "float", ("batch", 4, "latent_height", "latent_width")),
             InputSpec("timestep", "float", ("batch",)),
             InputSpec("encoder_hidden_states", "float", ("batch", 77, 768))),
    "vae_decoder": (InputSpec("latent_sample", "float", ("batch", 4, "latent_height", "latent_width")),),
}
SD_SIZES = SizeRange(min_size=256, max_size=1024, default_height=512, default_width=768, vae_scale=8)
CAN_BUILD_HERE = not missing_requirements()


def profiles(**kw):
    return {p.network: p for p in network_profiles(SD_INPUTS, SD_SIZES, ServingSettings(**kw))}


# --- profiles ----------------------------------------------------------------------------------------------------
def test_guidance_doubles_the_denoiser_and_text_encoder_rows_but_not_the_decoder():
    p = profiles(max_batch_size=8)
    assert p["unet"].batch_range == (1, 16, 16)
    assert p["text_encoder"].batch_range == (1, 16, 16)
    assert p["vae_decoder"].batch_range == (1, 8, 8)
    unet = p["unet"]
    assert unet.input("sample") == TensorProfile("sample", (1, 4, 32, 32), (16, 4, 64, 96), (16, 4, 128, 128))
    assert unet.input("timestep") == TensorProfile("timestep", (1,), (16,), (16,))
    assert unet.input("encoder_hidden_states") == TensorProfile("encoder_hidden_states", (1, 77, 768),
                                                                (16, 77, 768), (16, 77, 768))
    assert p["text_encoder"].input("input_ids") == TensorProfile("input_ids", (1, 77), (16, 77), (16, 77))
    assert p["vae_decoder"].input("latent_sample").opt == (8, 4, 64, 96)


def test_without_guidance_no_network_is_doubled():
    p = profiles(max_batch_size=8, cfg=False)
    assert [p[n].batch_range for n in ("text_encoder", "unet", "vae_decoder")] == [(1, 8, 8)] * 3


def test_buckets_set_the_largest_batch_and_the_opt_batch_is_the_bucket_a_full_batch_pads_to():
    p = profiles(max_batch_size=6, buckets=(1, 2, 4, 8))
    assert p["unet"].batch_range == (1, 16, 16)  # a batch of 5 or 6 runs padded to 8, plus 8 guidance rows
    assert p["vae_decoder"].batch_range == (1, 8, 8)
    p = profiles(max_batch_size=3, buckets=(8, 1, 4, 2))
    assert p["unet"].batch_range == (1, 8, 16)  # a full batch of 3 pads to 4: opt 4 requests, 8 rows


def test_opt_batch_flag_and_decode_cap():
    p = profiles(max_batch_size=8, opt_batch=2, max_decode_per_step=3)
    assert p["unet"].batch_range == (1, 4, 16)
    assert p["vae_decoder"].batch_range == (1, 2, 3)
    assert profiles(max_batch_size=8, max_decode_per_step=2)["vae_decoder"].batch_range == (1, 2, 2)


@pytest.mark.parametrize("kw, words", [
    ({"max_batch_size": 0}, "max_batch_size: 0"),
    ({"max_batch_size": 8, "buckets": (1, 2, 4)}, "largest bucket 4 is below max_batch_size 8"),
    ({"max_batch_size": 8, "buckets": (0, 8)}, "each bucket must be an integer >= 1"),
    ({"max_batch_size": 6, "buckets": (1, 2, 4, 8), "opt_batch": 3}, "opt_batch: 3 is not one of the buckets 1,2,4,8"),
    ({"max_batch_size": 8, "opt_batch": 9}, "from 1 to 8"),
    ({"max_batch_size": 8, "max_decode_per_step": 0}, "max_decode_per_step: 0"),
])
def test_bad_settings_say_what_is_allowed(kw, words):
    with pytest.raises(ValueError, match=words):
        ServingSettings(**kw)


def test_an_axis_the_exporter_does_not_know_is_refused():
    inputs = dict(SD_INPUTS, text_encoder=(InputSpec("input_ids", "int64", ("batch", "sequence")),))
    with pytest.raises(ValueError, match=r"text_encoder.input_ids: axis 'sequence'"):
        network_profiles(inputs, SD_SIZES, ServingSettings())


@settings(max_examples=200, deadline=None)
@given(max_batch=st.integers(1, 64), buckets=st.lists(st.integers(1, 128), max_size=6), cfg=st.booleans(),
       decode_cap=st.one_of(st.none(), st.integers(1, 64)), data=st.data())
def test_every_batch_the_server_can_run_is_inside_every_profile(max_batch, buckets, cfg, decode_cap, data):
    if buckets:
        buckets.append(data.draw(st.integers(max_batch, 128)))  # a full batch must be paddable
    s = ServingSettings(max_batch_size=max_batch, buckets=tuple(buckets), cfg=cfg, max_decode_per_step=decode_cap)
    p = {n.network: n for n in network_profiles(SD_INPUTS, SD_SIZES, s)}
    runnable = s.buckets or tuple(range(1, max_batch + 1))  # request batches the denoiser can be handed
    for n in runnable:
        for guided in (0, n) if cfg else (0,):
            assert p["unet"].input("sample").contains((n + guided, 4, 64, 96))
            assert p["unet"].input("timestep").contains((n + guided,))
            assert p["text_encoder"].input("input_ids").contains((n + guided, 77))
        assert p["vae_decoder"].input("latent_sample").contains((min(n, decode_cap or n), 4, 32, 128))
    for net in p.values():
        lo, opt, hi = net.batch_range
        assert 1 == lo <= opt <= hi
        for t in net.inputs:
            assert all(a <= b <= c for a, b, c in zip(t.min, t.opt, t.max))
            assert t.contains(t.min) and t.contains(t.opt) and t.contains(t.max)
    assert not p["unet"].input("sample").contains((p["unet"].batch_range[2] + 1, 4, 64, 64))


# --- the command against real ONNX exports ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def ort():
    require("onnx", "onnx")
    return require("onnxruntime", "onnx")


@pytest.fixture(scope="module")
def embedded_onnx(ort, tmp_path_factory):
    from stepserve.deploy.onnx_export import export_onnx

    return export_onnx("embedded", tmp_path_factory.mktemp("onnx") / "embedded", validate=False, show_progress=False)


@pytest.fixture(scope="module")
def tiny_onnx(ort, tiny_sd_path, tmp_path_factory):
    from stepserve.deploy.onnx_export import export_onnx

    return export_onnx(tiny_sd_path, tmp_path_factory.mktemp("onnx") / "tiny", validate=False, show_progress=False)


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


# A stand-in for the tensorrt module and an engine: the runner's binding logic on CPU tensors. Its execute copies
# the bytes of `copy_from` to the output address, so the test sees that the addresses bound are the tensors'.
class FakeTRT:
    class DataType:
        FLOAT, HALF, INT64 = "float", "half", "int64"

    class TensorIOMode:
        INPUT, OUTPUT = "in", "out"


class FakeContext:
    def __init__(self, engine):
        self.engine, self.shapes, self.addresses, self.streams = engine, {}, {}, []

    def set_input_shape(self, name, shape):
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, address):
        self.addresses[name] = address

    def get_tensor_shape(self, name):
        return self.shapes[self.engine.copy_from]

    def execute_async_v3(self, stream):
        self.streams.append(stream)
        nbytes = int(np.prod(self.shapes[self.engine.copy_from])) * 4
        ctypes.memmove(self.addresses[self.engine.output], self.addresses[self.engine.copy_from], nbytes)
        return True


class FakeEngine:
    def __init__(self, inputs, output, copy_from):
        self.io = {**{n: ("in", d, p) for n, (d, p) in inputs.items()}, output: ("out", "float", None)}
        self.output, self.copy_from = output, copy_from
        self.num_io_tensors = len(self.io)

    def get_tensor_name(self, i):
        return list(self.io)[i]

    def get_tensor_mode(self, name):
        return self.io[name][0]

    def get_tensor_dtype(self, name):
        return self.io[name][1]

    def get_tensor_profile_shape(self, name, profile):
        assert profile == 0
        return self.io[name][2]

    def create_execution_context(self):
        self.context = FakeContext(self)
        return self.context


def fake_unet_runner(monkeypatch):
    engine = FakeEngine({"sample": ("float", [(1, 4, 8, 8), (8, 4, 8, 8), (16, 4, 8, 8)]),
                         "timestep": ("float", [(1,), (8,), (16,)]),
                         "encoder_hidden_states": ("float", [(1, 16, 64), (8, 16, 64), (16, 16, 64)])},
                        "out_sample", copy_from="sample")
    runner = EngineRunner("unet", engine, FakeTRT, torch.device("cpu"))
    monkeypatch.setattr(runner, "stream_handle", lambda: 1234)
    return runner, engine


def test_the_runner_binds_contiguous_inputs_and_an_output_of_the_inferred_shape(monkeypatch):
    runner, engine = fake_unet_runner(monkeypatch)
    networks = TensorRTNetworks(None, runner, None)
    sample = torch.randn(3, 8, 8, 4).permute(0, 3, 1, 2)  # not contiguous: the runner must copy it
    assert not sample.is_contiguous()
    out = networks.denoise(sample, torch.arange(3.0), torch.randn(3, 16, 64))
    assert torch.equal(out, sample) and out.dtype == torch.float32
    assert engine.context.shapes == {"sample": (3, 4, 8, 8), "timestep": (3,), "encoder_hidden_states": (3, 16, 64)}
    assert engine.context.addresses["out_sample"] == out.data_ptr() and engine.context.streams == [1234]


def test_the_runner_refuses_shapes_outside_the_profile(monkeypatch):
    runner, engine = fake_unet_runner(monkeypatch)
    feeds = {"sample": torch.zeros(17, 4, 8, 8), "timestep": torch.zeros(17), "encoder_hidden_states":
             torch.zeros(17, 16, 64)}
    with pytest.raises(ValueError, match=r"unet: input sample of shape \[17, 4, 8, 8\] is outside the engine's "
                                         r"optimization profile \(min \[1, 4, 8, 8\], max \[16, 4, 8, 8\]\)"):
        runner.run(feeds)
    with pytest.raises(ValueError, match="input sample of shape"):
        runner.run(dict(feeds, sample=torch.zeros(2, 4, 16, 16)))
    assert engine.context.streams == []  # nothing was enqueued


def test_the_runner_refuses_an_engine_that_is_not_the_network_it_stands_for():
    engine = FakeEngine({"latent_sample": ("float", [(1, 4, 8, 8)] * 3)}, "sample", copy_from="latent_sample")
    with pytest.raises(ValueError, match="are not those of a stepserve unet"):
        EngineRunner("unet", engine, FakeTRT, torch.device("cpu"))
