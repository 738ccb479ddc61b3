"""Every forward of the engine runs under torch.inference_mode(): the encoders, the denoiser, ControlNets,
IP-Adapters, step caching and the VAE, for every family with a tiny builder and every add-on. A module-wide forward
hook sees each forward while one request is served (a preview included); none may run with autograd on, and no
output may require grad (a ControlNet's weights do: its forward outside no_grad kept its whole graph alive)."""

from __future__ import annotations

import importlib

import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.engine.config import EngineConfig, build_engine

from extras import require


def _tiny(family: str):
    def build(root, sd_path):
        if family == "sd":
            return sd_path
        return getattr(importlib.import_module(f"stepserve.tiny.{family}"), f"build_tiny_{family}")(root / family)
    return build


def _controlnet(root, pipe, _):
    from control_reference import build_controlnets

    return {"controlnet_dir": str(build_controlnets(pipe, root / "controlnets"))}


def _ip_adapter(root, pipe, _):
    from ip_adapter_reference import build_ip_adapters

    return {"ip_adapter_dir": str(build_ip_adapters(pipe, root / "ip_adapters"))}


def _lora(root, pipe, _):
    require("peft", "lora")
    from stepserve.tiny.lora import build_tiny_lora

    build_tiny_lora(pipe, root / "loras" / "ink.safetensors")
    return {"lora_dir": str(root / "loras")}


def _image(seed: int, size: int):
    from edit_images import start_image

    return start_image(seed, size=size)


# case: (family, its request size, engine options from (root, pipe, size), the request's add-on fields from size)
CASES = {
    "sd": ("sd", 16, None, {}),
    "sdxl": ("sdxl", 16, None, {}),
    "sd3": ("sd3", 32, None, {"sampler": "flow_euler"}),
    "flux": ("flux", 32, None, {"sampler": "flow_euler"}),
    "flux2": ("flux2", 32, None, {"sampler": "flow_euler"}),
    "qwenimage": ("qwenimage", 32, None, {"sampler": "flow_euler"}),
    "wan": ("wan", 32, None, {"sampler": "flow_euler"}),
    "sd+lora": ("sd", 16, _lora, {"loras": [{"name": "ink", "scale": 0.8}]}),
    "sd+controlnet": ("sd", 16, _controlnet, {"controls": [{"name": "pose", "image": ("image", 16)}]}),
    "flux+controlnet": ("flux", 32, _controlnet, {"sampler": "flow_euler",
                                                  "controls": [{"name": "pose", "image": ("image", 32)}]}),
    "sd+ip_adapter": ("sd", 16, _ip_adapter, {"ip_adapter": {"name": "face", "image": ("image", 24)}}),
    "sd+cache": ("sd", 16, None, {"cache": "deepcache"}),
    "flux+cache": ("flux", 32, None, {"sampler": "flow_euler", "cache": "magcache"}),
    "sd+img2img": ("sd", 16, None, {"image": ("image", 16)}),
}


def _filled(value):
    """The case's fields with each ("image", size) made a picture."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "image":
        return _image(7, value[1])
    if isinstance(value, dict):
        return {k: _filled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_filled(v) for v in value]
    return value


@pytest.mark.parametrize("case", list(CASES))
def test_no_forward_of_a_step_tracks_gradients(case, tiny_sd_path, tmp_path):
    family, size, addon, fields = CASES[case]
    pipe = _tiny(family)(tmp_path, tiny_sd_path)
    options = addon(tmp_path, pipe, size) if addon else {}
    built = build_engine(EngineConfig(model=str(pipe), memory_cap=False, warm_up=False, **options),
                         say=lambda _: None)
    engine = Engine(built.executor, options=built.options)
    seen: list[str] = []
    tracked: list[str] = []

    def watch(module, args, output):
        seen.append(type(module).__name__)
        if torch.is_grad_enabled() or not torch.is_inference_mode_enabled() or any(
                t.requires_grad for t in _tensors(output)):
            tracked.append(type(module).__name__)

    params = SamplingParams(prompt="a small cat", seed=3, num_inference_steps=3, height=size, width=size,
                            **_filled(fields))
    handle = torch.nn.modules.module.register_module_forward_hook(watch)
    try:
        result = engine.generate([params])[0]
        preview = engine.executor.preview(_finished_like(engine, params))
    finally:
        handle.remove()
    assert result.ok, result.error
    assert preview is not None
    assert seen, "no forward was seen"
    assert not tracked, f"forwards with autograd on: {sorted(set(tracked))}"


def _tensors(value):
    """The tensors in a forward's output (a tensor, a tuple or list, a dict or a diffusers output)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _finished_like(engine, params):
    """A request with latents, for a preview outside any stage (the engine thread asks for one between steps)."""
    request = engine.core.new_request(params, 0.0, "preview")
    engine.executor.prepare([request])
    return request
