"""A bad ip_adapter fails that request alone with an error naming the field (ip_adapter.scale, ip_adapter[1].name,
...) and what is allowed; a model that runs no IP-Adapters refuses one clearly; --ip-adapter-dir is checked at
start-up."""

import argparse
from dataclasses import replace

import pytest
from edit_images import start_image
from ip_adapter_reference import build_ip_adapters, request

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.commands.flags import check_cache_and_lora_flags
from stepserve.ipadapter.serving import serve_ip_adapters
from stepserve.request.validation import resolve_params
from stepserve.server.startup import StartupError


@pytest.fixture(scope="module")
def engine(tiny_sd_path, tmp_path_factory):
    folder = build_ip_adapters(tiny_sd_path, tmp_path_factory.mktemp("ip_adapters"))
    return Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", ip_adapter_dir=str(folder))


IMAGE = start_image(0)


def with_prompt(ip_adapter, **extra):
    return SamplingParams(prompt="a cat", seed=1, num_inference_steps=4, height=16, width=16, ip_adapter=ip_adapter,
                          **extra)


@pytest.mark.parametrize("ip_adapter,field,says", [
    ({"name": "nope", "image": IMAGE}, "ip_adapter.name", "served: face, style"),
    ({"name": "face", "image": IMAGE, "scale": -1}, "ip_adapter.scale", "must be a number in [0, 10]"),
    ({"name": "face", "image": IMAGE, "scale": float("nan")}, "ip_adapter.scale", "must be a number"),
    ({"name": "face", "image": IMAGE, "scale": True}, "ip_adapter.scale", "must be a number"),
    ({"name": "face", "image": "not a picture"}, "ip_adapter.image", "expected a PIL image"),
    ({"name": "face"}, "ip_adapter", "expected {\"name\": ..., \"image\": ...}"),
    ({"name": "face", "image": IMAGE, "weight": 1}, "ip_adapter", "unknown key(s) weight"),
    ([], "ip_adapter", "expected 1 to 4 image prompts, got 0"),
    ([{"name": "face", "image": IMAGE}] * 5, "ip_adapter", "expected 1 to 4 image prompts, got 5"),
    ([{"name": "face", "image": IMAGE}, {"name": "face", "image": IMAGE}], "ip_adapter[1].name",
     "'face' is named twice"),
    ([{"name": "face", "image": IMAGE}, {"name": "style", "image": IMAGE, "scale": 11}], "ip_adapter[1].scale",
     "must be a number in [0, 10]"),
    ([{"name": "face", "image": IMAGE}, "style"], "ip_adapter[1]", "expected {\"name\": ..., \"image\": ...}"),
])
def test_bad_ip_adapter_names_the_field(engine, ip_adapter, field, says):
    with pytest.raises(ValidationError) as err:
        engine.generate([with_prompt(ip_adapter)])
    assert err.value.field == field and says in str(err.value), str(err.value)


def test_an_image_prompt_takes_step_caching_and_the_servers_default(engine):
    cached = resolve_params(with_prompt({"name": "face", "image": IMAGE}, cache="deepcache"), engine.model_info)
    assert cached.cache.policy == "deepcache" and cached.ip_adapter[0].name == "face"
    info = replace(engine.model_info, default_cache=resolve_params(with_prompt(None, cache="fbcache"),
                                                                   engine.model_info).cache)
    assert resolve_params(with_prompt({"name": "face", "image": IMAGE}), info).cache.policy == "fbcache"


def test_a_family_without_ip_adapters_refuses_them(engine):
    info = replace(engine.model_info, ip_adapters=False, family="flux", name="tiny-flux")
    with pytest.raises(ValidationError) as err:
        resolve_params(with_prompt({"name": "face", "image": IMAGE}), info)
    assert err.value.field == "ip_adapter" and "takes no IP-Adapter" in str(err.value) and "SD 1/2" in str(err.value)


def test_without_a_folder_no_name_is_served(tiny_sd_path):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous")
    with pytest.raises(ValidationError) as err:
        engine.generate([request(1, "face")])
    assert err.value.field == "ip_adapter.name" and "--ip-adapter-dir" in str(err.value)


def test_an_adapter_of_another_model_fails_that_request_alone(engine):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from stepserve.tiny.ipadapter import WEIGHTS

    folder = engine.executor.ip_adapters().root
    wide = folder / "wide"
    shutil.copytree(folder / "face", wide)
    tensors = load_file(str(wide / WEIGHTS))  # image tokens 64 wide for a UNet whose cross-attention takes 32
    tensors["image_proj.proj.weight"] = torch.zeros(4 * 64, 16)
    save_file(tensors, str(wide / WEIGHTS))
    try:
        bad, fine = engine.generate([request(2, "wide"), request(3, "face")])
    finally:
        shutil.rmtree(wide)
    assert not bad.ok and "does not fit" in bad.error and "cross_attention_dim is 32" in bad.error, bad.error
    assert fine.ok, fine.error


def test_bad_flags_are_refused_before_the_model_loads():
    base = dict(cache=None, lora_dir=None, controlnet_dir=None, backend="torch", compile=False, deterministic=False)
    for values, says in (({"ip_adapter_dir": "/no/such/folder"}, "--ip-adapter-dir: '/no/such/folder' is not a "
                                                                   "folder"),
                         ({"ip_adapter_dir": ".", "backend": "onnxruntime"}, "--ip-adapter-dir need --backend torch")):
        with pytest.raises(StartupError) as err:
            check_cache_and_lora_flags(argparse.Namespace(**{**base, **values}))
        assert says in str(err.value)


def test_a_family_without_ip_adapters_refuses_the_folder(tmp_path):
    from stepserve.engine.loading import load_executor
    from stepserve.tiny.flux import build_tiny_flux

    executor = load_executor(str(build_tiny_flux(tmp_path / "flux")))
    assert not executor.model_info.ip_adapters
    with pytest.raises(ValueError, match="SD 1/2 and SDXL models on the torch backend"):
        serve_ip_adapters(executor, str(tmp_path))


@pytest.mark.parametrize("value", ["0", "-5", "lots"])
def test_a_bad_ip_adapter_memory_is_refused_naming_the_flag(value, capsys):
    from stepserve.commands.serve import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ip-adapter-memory-mb", value])
    assert "--ip-adapter-memory-mb" in capsys.readouterr().err
