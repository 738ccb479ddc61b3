"""`stepserve export triton` without a server: every config.pbtxt both layouts write (and both network backends of
the classic one) is a valid Triton ModelConfig that round-trips, states the contract clients rely on, and the CLI
refuses what it cannot do with one clear line."""

from __future__ import annotations

import json

import pytest
from extras import require

from stepserve.commands.export_triton import main as export_main
from stepserve.deploy.triton.config import NETWORK_MODELS, PIPELINE_INPUTS
from stepserve.deploy.triton.repository import RepositoryOptions, write_repository

OPTIONAL = {"negative_prompt", "sampler", "height", "width", "timeout_s", "cache", "loras"}


@pytest.fixture(scope="module")
def onnx_dir(embedded_onnx):
    return embedded_onnx


@pytest.fixture(scope="module")
def repos(onnx_dir, tmp_path_factory):
    """Every layout: stepserve, classic with Python-backend networks, classic with onnxruntime-backend networks."""
    root = tmp_path_factory.mktemp("repos")
    return {
        "stepserve": write_repository(onnx_dir, root / "stepserve", RepositoryOptions(
            mode="stepserve", max_batch_size=6, max_queue=5, strategy="slo", threads=1), quiet=True),
        "classic": write_repository(onnx_dir, root / "classic", RepositoryOptions(
            mode="classic", max_batch_size=4, max_queue_delay_ms=25, max_queue=9), quiet=True),
        "classic-ort": write_repository(onnx_dir, root / "classic-ort", RepositoryOptions(
            mode="classic", network_backend="onnxruntime", max_batch_size=3, network_max_queue_delay_ms=1.5),
            quiet=True),
    }


def parse(text: str):
    require("tritonclient.grpc", "triton")
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    again = text_format.Parse(text_format.MessageToString(config), model_config_pb2.ModelConfig())
    assert again == config, "config.pbtxt does not round-trip"
    return config


def configs(repo) -> dict:
    return {p.parent.name: parse(p.read_text()) for p in sorted(repo.glob("*/config.pbtxt"))}


def check_entry_model(config, max_batch_size: int) -> None:
    from tritonclient.grpc import model_config_pb2

    types = model_config_pb2.DataType
    assert config.name == "pipeline" and config.backend == "python" and config.max_batch_size == max_batch_size
    assert [i.name for i in config.input] == [s.name for s in PIPELINE_INPUTS]
    for i in config.input:
        assert list(i.dims) == [1]
        assert i.optional == (i.name in OPTIONAL), i.name
    kinds = {i.name: types.Name(i.data_type) for i in config.input}
    assert kinds == {"prompt": "TYPE_STRING", "negative_prompt": "TYPE_STRING", "seed": "TYPE_INT64",
                     "steps": "TYPE_INT32", "guidance_scale": "TYPE_FP32", "sampler": "TYPE_STRING",
                     "height": "TYPE_INT32", "width": "TYPE_INT32", "timeout_s": "TYPE_FP32",
                     "cache": "TYPE_STRING", "loras": "TYPE_STRING"}
    (image,) = config.output
    assert image.name == "image" and types.Name(image.data_type) == "TYPE_UINT8" and list(image.dims) == [-1, -1, -1]
    assert [(g.kind, g.count) for g in config.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 1)]


def test_the_stepserve_entry_model_is_decoupled_and_carries_the_engine_settings(repos):
    (config,) = configs(repos["stepserve"]).values()
    check_entry_model(config, 6)
    assert config.model_transaction_policy.decoupled
    assert not config.HasField("dynamic_batching"), "stepserve's engine batches; Triton must hand requests over"
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params == {"strategy": "slo", "max_batch_size": "6", "max_queue_delay_ms": "50", "backend": "onnxruntime",
                      "max_queue": "5", "threads": "1"}
    folder = repos["stepserve"] / "pipeline" / "1"
    assert (folder / "export" / "unet.onnx").is_file() and (folder / "export" / "manifest.json").is_file()
    assert "stepserve.server.triton.stepserve_pipeline" in (folder / "model.py").read_text()


def test_the_classic_layout_batches_whole_requests_in_the_entry_model_and_each_network(repos):
    found = configs(repos["classic"])
    assert set(found) == {"pipeline", *NETWORK_MODELS}
    entry = found["pipeline"]
    check_entry_model(entry, 4)
    assert not entry.model_transaction_policy.decoupled
    assert list(entry.dynamic_batching.preferred_batch_size) == [4]
    assert entry.dynamic_batching.max_queue_delay_microseconds == 25_000
    assert entry.dynamic_batching.default_queue_policy.max_queue_size == 9
    assert {k: v.string_value for k, v in entry.parameters.items()} == {"network_max_batch_size": "8",
                                                                        "export_dir": "export"}
    manifest = json.loads((repos["classic"] / "pipeline" / "1" / "export" / "manifest.json").read_text())
    for name in NETWORK_MODELS:
        net = found[name]
        assert net.backend == "python" and net.max_batch_size == 8  # guidance doubles the UNet's rows
        assert list(net.dynamic_batching.preferred_batch_size) == [8]
        assert net.dynamic_batching.max_queue_delay_microseconds == 0
        assert not net.dynamic_batching.HasField("default_queue_policy")
        assert [i.name for i in net.input] == [i["name"] for i in manifest["networks"][name]["inputs"]]
        assert [o.name for o in net.output] == [o["name"] for o in manifest["networks"][name]["outputs"]]
        assert (repos["classic"] / name / "1" / "model.onnx").is_file()
        assert (repos["classic"] / name / "1" / "model.py").is_file()
    timestep = next(i for i in found["unet"].input if i.name == "timestep")
    assert list(timestep.dims) == [1] and list(timestep.reshape.shape) == []  # (batch,) on the wire as (batch, 1)
    sample = next(i for i in found["unet"].input if i.name == "sample")
    assert list(sample.dims) == [4, -1, -1]
    # the networks' graphs were moved, not copied: the entry model keeps only configs and the tokenizer
    assert not list((repos["classic"] / "pipeline" / "1" / "export").glob("*.onnx"))


def test_the_stock_triton_variant_names_the_onnxruntime_backend_and_no_python_code(repos):
    found = configs(repos["classic-ort"])
    for name in NETWORK_MODELS:
        assert found[name].backend == "onnxruntime" and found[name].max_batch_size == 6
        assert found[name].dynamic_batching.max_queue_delay_microseconds == 1500
        assert not (repos["classic-ort"] / name / "1" / "model.py").exists()
        assert (repos["classic-ort"] / name / "1" / "model.onnx").is_file()
    assert found["pipeline"].backend == "python"  # the BLS entry model runs in the Python backend everywhere


def test_the_cli_refuses_flags_of_the_other_mode_and_a_folder_it_did_not_write(tmp_path, capsys):
    assert export_main(["--out", str(tmp_path / "a"), "--mode", "classic", "--strategy", "slo"]) == 2
    assert "--strategy applies to --mode stepserve only" in capsys.readouterr().err
    assert export_main(["--out", str(tmp_path / "b"), "--network-backend", "onnxruntime"]) == 2
    assert "--network-backend applies to --mode classic only" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    assert export_main(["--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "not an empty folder or an earlier Triton repository" in err and err.count("\n") == 1
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"
    with pytest.raises(SystemExit):
        export_main(["--out", str(tmp_path / "d"), "--max-batch-size", "0"])
    assert "expected an integer >= 1" in capsys.readouterr().err


def test_rewriting_a_repository_replaces_its_layout(onnx_dir, tmp_path):
    repo = write_repository(onnx_dir, tmp_path / "r", RepositoryOptions(mode="classic"), quiet=True)
    write_repository(onnx_dir, repo, RepositoryOptions(mode="stepserve"), quiet=True)
    assert sorted(p.name for p in repo.iterdir()) == ["pipeline", "stepserve-triton.json"]
    assert json.loads((repo / "stepserve-triton.json").read_text())["mode"] == "stepserve"
