"""--controlnet-dir at start-up: a missing folder, another backend, or a family without ControlNets is refused
naming the flag; the engine says what it serves."""

import argparse

import pytest

from stepserve.commands.flags import check_cache_and_lora_flags
from stepserve.controls.serving import serve_controlnets
from stepserve.engine.loading import load_executor
from stepserve.server.startup import StartupError


def flags(**values):
    base = dict(cache=None, lora_dir=None, controlnet_dir=None, backend="torch", compile=False, deterministic=False)
    return argparse.Namespace(**{**base, **values})


@pytest.mark.parametrize("values,says", [
    ({"controlnet_dir": "/no/such/folder"}, "--controlnet-dir: '/no/such/folder' is not a folder"),
    ({"controlnet_dir": ".", "backend": "onnxruntime"}, "--controlnet-dir need --backend torch"),
    ({"controlnet_dir": ".", "compile": True}, "--compile with --controlnet-dir is not served"),
])
def test_bad_flags_are_refused_before_the_model_loads(values, says):
    with pytest.raises(StartupError) as err:
        check_cache_and_lora_flags(flags(**values))
    assert says in str(err.value)


def test_serving_a_folder_says_what_it_serves(tmp_path, tiny_sd_path):
    from stepserve.tiny.controlnet import build_tiny_controlnet

    build_tiny_controlnet(tiny_sd_path, tmp_path / "pose")
    (tmp_path / "notes").mkdir()  # no config: not a ControlNet
    executor = load_executor(str(tiny_sd_path))
    line = serve_controlnets(executor, str(tmp_path), 64.0)
    assert "1 in" in line and "(pose)" in line and "64 MiB" in line
    assert executor.model_info.control_names == frozenset({"pose"}) and executor.model_info.controls
    with pytest.raises(ValueError, match="is not a folder"):
        serve_controlnets(executor, str(tmp_path / "missing"), None)


def test_a_family_without_controlnets_is_refused(tmp_path):
    from stepserve.tiny.wan import build_tiny_wan

    executor = load_executor(str(build_tiny_wan(tmp_path / "wan")))
    assert not executor.model_info.controls
    with pytest.raises(ValueError, match=r"\(wan family\) runs no ControlNets here; they are served for SD 1/2, "
                                         r"SDXL, SD3, Flux.1 and Qwen-Image models on the torch backend"):
        serve_controlnets(executor, str(tmp_path), None)
