"""Each family's declaration (stepserve/capabilities.py) against its adapter: every registered family has one, an
add-on it declares has its Protocol's hooks, the caches it declares are the ones its networks run, and the
add-ons run only where the declaration says (not on an export, not on the fast path's wrappers)."""

import pytest

from stepserve import capabilities as caps
from stepserve.pipelines.registry import FAMILIES, adapter_class
from stepserve.request.types import ModelInfo

ADAPTERS = sorted({adapter_class(name) for name in FAMILIES}, key=lambda c: c.__name__)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda c: c.__name__)
def test_every_family_is_declared_with_the_hooks_of_what_it_declares(adapter):
    declared = caps.FAMILIES.get(adapter.family)
    assert declared is not None, f"{adapter.__name__}: family {adapter.family!r} has no declaration"
    assert caps.missing_hooks(adapter, declared) == []
    assert adapter.torch_networks is not None  # where its add-ons run
    own = getattr(adapter.torch_networks, "cache_policies", ())
    if isinstance(own, tuple):  # a class attribute (a UNet's depends on its blocks: checked below on tiny SD)
        assert own == declared.caches


def test_a_declared_add_on_without_its_hooks_is_named():
    class Bare:
        family = "bare"

    declared = caps.Capabilities("bare", "Bare", controlnets=True, ip_adapter=True, lora=True)
    missing = caps.missing_hooks(Bare, declared)
    assert "controlnets: control_forward" in missing and "ip_adapter: unet" in missing
    assert "lora: lora_loader" in missing


def test_an_undeclared_family_serves_nothing_and_the_words_follow_the_table():
    assert caps.capabilities("nope") == caps.Capabilities("nope", "nope")  # every feature off
    assert caps.served_for("controlnets") == "SD 1/2, SDXL, SD3, Flux.1 and Qwen-Image"
    assert caps.served_for("ip_adapter") == "SD 1/2 and SDXL"
    assert caps.served_for("video") == "Wan"


def info(family: str, **extra) -> ModelInfo:
    return ModelInfo(name="m", default_sampler="flow_euler", default_steps=4, default_guidance_scale=1.0,
                     default_height=16, default_width=16, size_multiple=16, min_size=16, max_size=64,
                     family=family, **extra)


def test_refusals_name_the_families_the_declarations_name():
    import re

    import numpy as np

    from stepserve import ValidationError
    from stepserve.request.types import SamplingParams
    from stepserve.request.validation import resolve_params

    picture = np.zeros((16, 16, 3), dtype=np.uint8)
    for p, words in ((SamplingParams(prompt="x", image=picture), caps.served_for("img2img")),
                     (SamplingParams(prompt="x", ip_adapter={"name": "a", "image": picture}),
                      caps.where_served("ip_adapter")),
                     (SamplingParams(prompt="x", controls=[{"name": "a", "image": picture}]),
                      caps.where_served("controlnets"))):
        with pytest.raises(ValidationError, match=re.escape(words)):
            resolve_params(p, info("flux2"))


def test_validation_reads_the_declaration(monkeypatch):
    """Controls with an image follow `controls_with_image`, not a list of its own: declaring it for SD3 lets an SD3
    image-to-image request with controls through to the ControlNet names."""
    from stepserve.controls.spec import ControlSpecError
    from stepserve.request.control_params import resolve_controls
    from stepserve.request.types import SamplingParams

    model = info("sd3", controls=True, control_names=frozenset({"edges"}))
    p = SamplingParams(prompt="x", controls=[{"name": "edges", "image": "pic"}], image="start")
    with pytest.raises(ControlSpecError, match=r"no controls with an image .*served for SD 1/2, SDXL and Flux.1"):
        resolve_controls(p, model, "start", lambda field, v: v)
    monkeypatch.setitem(caps.FAMILIES, "sd3", caps.Capabilities("sd3", "SD3", controlnets=True,
                                                                controls_with_image=True))
    assert resolve_controls(p, model, "start", lambda field, v: v)[0].name == "edges"


def test_add_ons_run_on_the_own_torch_networks_only(tiny_sd_path):
    from stepserve.pipelines.diffusers_sd import StableDiffusionAdapter

    adapter = StableDiffusionAdapter.from_pretrained(str(tiny_sd_path))
    assert adapter.runs_controls and adapter.runs_ip_adapters
    assert adapter.networks.cache_policies == adapter.capabilities.caches
    adapter.networks = object()  # the fast path's wrapper, an export's runtime
    assert not adapter.runs_controls and not adapter.runs_ip_adapters


def test_a_family_declaring_an_add_on_it_has_no_hooks_for_is_refused_when_looked_up(monkeypatch):
    monkeypatch.setitem(caps.FAMILIES, "wan", caps.Capabilities("wan", "Wan", video=True, controlnets=True))
    with pytest.raises(TypeError, match="declares what it has no hooks for: controlnets: control_forward"):
        adapter_class("WanPipeline")
