"""The TensorRT code that needs TensorRT and a GPU, driven through stand-in objects: the engine runner's shape
checks and tensor bindings, and the builder calls of `stepserve export tensorrt` where TensorRT and a GPU exist.
The real API is not exercised here; the stand-ins follow the TensorRT 10 calls the code makes."""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np
import pytest
import torch

from stepserve.backends.tensorrt import EngineRunner, TensorRTNetworks
from stepserve.commands import export_tensorrt as cli


def run_cli(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


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


# A stand-in for the TensorRT builder API: records what build_engine asks of it; the "engine" it serializes is
# the JSON of what it was given. Its parser reads the real ONNX graph's inputs.
class FakeBuilderTRT:
    __version__ = "10.fake"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            self.level = level

    class MemoryPoolType:
        WORKSPACE = "workspace"

    class BuilderFlag:
        FP16 = "fp16"

    class Builder:
        def __init__(self, logger):
            self.config = None

        def create_network(self, flags):
            assert flags == 0  # TensorRT 10: explicit batch without a flag
            return FakeNetwork()

        def create_builder_config(self):
            self.config = FakeConfig()
            return self.config

        def create_optimization_profile(self):
            return FakeProfile()

        def build_serialized_network(self, network, config):
            return json.dumps({"inputs": network.names, **config.__dict__}).encode()

    class OnnxParser:
        def __init__(self, network, logger):
            self.network, self.num_errors = network, 0

        def parse_from_file(self, path):
            import onnx

            self.network.names = [i.name for i in onnx.load(path, load_external_data=False).graph.input]
            return True


class FakeNetwork:
    def __init__(self):
        self.names: list[str] = []

    @property
    def num_inputs(self):
        return len(self.names)

    def get_input(self, i):
        return type("Input", (), {"name": self.names[i]})


class FakeConfig:
    def __init__(self):
        self.pool, self.flags, self.profiles = {}, [], []

    def set_memory_pool_limit(self, pool, size):
        self.pool[pool] = size

    def set_flag(self, flag):
        self.flags.append(flag)

    def add_optimization_profile(self, profile):
        self.profiles.append({name: [list(s) for s in shapes] for name, shapes in profile.items()})


class FakeProfile(dict):
    def set_shape(self, name, lo, opt, hi):
        self[name] = (lo, opt, hi)


@pytest.mark.parametrize("fp16", [False, True])
def test_where_tensorrt_and_a_gpu_exist_the_builder_gets_the_same_profiles(fp16, embedded_onnx, tmp_path, capsys,
                                                                          monkeypatch):
    import stepserve.deploy.tensorrt_build as build

    monkeypatch.setitem(sys.modules, "tensorrt", FakeBuilderTRT)
    monkeypatch.setattr(build, "missing_requirements", list)
    monkeypatch.setattr(build, "tensorrt_version", lambda: FakeBuilderTRT.__version__)
    out = tmp_path / "engines"
    rc, stdout, err = run_cli(["--onnx", embedded_onnx, "--out", out, "--max-batch-size", "2",
                               "--workspace-mib", "64", *(["--fp16"] if fp16 else [])], capsys)
    assert rc == 0 and "built 3 engines" in stdout and "building unet.plan (batch 1..4, opt 4" in err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["built"] is True and manifest["missing"] == [] and manifest["tensorrt_version"] == "10.fake"
    for name, net in manifest["networks"].items():
        plan = json.loads((out / net["engine"]).read_text())
        assert plan["inputs"] == list(net["profiles"][0]), name
        assert plan["profiles"] == [{t: [s["min"], s["opt"], s["max"]] for t, s in net["profiles"][0].items()}]
        assert plan["pool"] == {"workspace": 64 << 20}
        assert plan["flags"] == (["fp16"] if fp16 else [])
        assert ("--fp16" in net["trtexec"]) == fp16
