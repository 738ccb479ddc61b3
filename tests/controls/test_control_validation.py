"""Bad controls fail that request alone with an error naming the field (controls[i].scale, ...) and what is
allowed; a model that runs no ControlNets refuses them clearly."""

from dataclasses import replace

import pytest
from control_reference import build_controlnets, request
from edit_images import start_image

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.request.validation import resolve_params


@pytest.fixture(scope="module")
def engine(tiny_sd_path, tmp_path_factory):
    folder = build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))
    return Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", controlnet_dir=str(folder))


def with_controls(controls, **extra):
    return SamplingParams(prompt="a cat", seed=1, num_inference_steps=4, height=16, width=16, controls=controls,
                          **extra)


IMAGE = start_image(0)


@pytest.mark.parametrize("controls,field,says", [
    ([{"name": "nope", "image": IMAGE}], "controls[0].name", "served: depth, edge, pose"),
    ([{"name": "pose", "image": IMAGE}, {"name": "depth", "image": IMAGE, "scale": -1}], "controls[1].scale",
     "must be a number in [0, 10]"),
    ([{"name": "pose", "image": IMAGE, "scale": float("nan")}], "controls[0].scale", "must be a number"),
    ([{"name": "pose", "image": IMAGE, "start": 0.6, "end": 0.4}], "controls[0].start", "must be below end"),
    ([{"name": "pose", "image": IMAGE, "end": 1.5}], "controls[0].end", "in [0, 1]"),
    ([{"name": "pose", "image": IMAGE, "start": True}], "controls[0].start", "in [0, 1]"),
    ([{"name": "pose", "image": "not a picture"}], "controls[0].image", "expected a PIL image"),
    ([{"name": "pose"}], "controls[0]", "expected {\"name\": ..., \"image\": ...}"),
    ([{"name": "pose", "image": IMAGE, "weight": 1}], "controls[0]", "unknown key(s) weight"),
    ([{"name": "pose", "image": IMAGE}, {"name": "pose", "image": IMAGE}], "controls[1].name", "named twice"),
    ([{"name": n, "image": IMAGE} for n in ("pose", "depth", "edge", "pose", "depth")], "controls",
     "at most 4 per request"),
    ({"name": "pose"}, "controls", "expected a list"),
    ([{"name": "pose", "image": IMAGE, "guess_mode": "yes"}], "controls[0].guess_mode", "must be true or false"),
    ([{"name": "pose", "image": IMAGE, "guess_mode": True}, {"name": "depth", "image": IMAGE, "guess_mode": False}],
     "controls[1].guess_mode", "one setting per request and controls[0] says true; allowed: true or unset"),
])
def test_bad_controls_name_the_field(engine, controls, field, says):
    with pytest.raises(ValidationError) as err:
        engine.generate([with_controls(controls)])
    assert err.value.field == field and says in str(err.value), str(err.value)


def test_controls_with_a_start_image_or_step_caching_are_taken_on_a_unet(engine):
    edit = with_controls([{"name": "pose", "image": IMAGE}], image=IMAGE, strength=0.5)
    assert resolve_params(edit, engine.model_info).controls[0].name == "pose"
    cached = resolve_params(with_controls([{"name": "pose", "image": IMAGE}], cache="deepcache"), engine.model_info)
    assert cached.cache.policy == "deepcache" and cached.controls[0].name == "pose"
    info = replace(engine.model_info, default_cache=resolve_params(with_controls(None, cache="fbcache"),
                                                                   engine.model_info).cache)
    assert resolve_params(with_controls([{"name": "pose", "image": IMAGE}]), info).cache.policy == "fbcache"


def test_controls_with_step_caching_on_a_transformer_are_refused_and_the_default_cache_left_out(engine):
    flux = replace(engine.model_info, family="flux", name="tiny-flux", cache_policies=("fbcache", "magcache"))
    with pytest.raises(ValidationError) as err:
        resolve_params(with_controls([{"name": "pose", "image": IMAGE}], cache="fbcache"), flux)
    assert err.value.field == "cache" and "does not combine with controls on tiny-flux" in str(err.value)
    info = replace(flux, default_cache=resolve_params(with_controls(None, cache="fbcache"), engine.model_info).cache)
    assert resolve_params(with_controls([{"name": "pose", "image": IMAGE}]), info).cache is None
    assert resolve_params(with_controls(None), info).cache is not None


def test_a_family_without_controlnets_refuses_them(engine):
    info = replace(engine.model_info, controls=False, family="wan", name="tiny-wan")
    with pytest.raises(ValidationError) as err:
        resolve_params(with_controls([{"name": "pose", "image": IMAGE}]), info)
    assert err.value.field == "controls" and "takes no ControlNets" in str(err.value)
    assert "served for SD 1/2, SDXL, SD3, Flux.1 and Qwen-Image models on the torch backend" in str(err.value)


def test_without_a_controlnet_folder_no_name_is_served(tiny_sd_path):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous")
    with pytest.raises(ValidationError) as err:
        engine.generate([request(1, (("pose", 1.0, 0.0, 1.0),))])
    assert err.value.field == "controls[0].name" and "--controlnet-dir" in str(err.value)


def test_a_controlnet_of_another_model_fails_that_request_alone(engine, tmp_path):
    import json

    folder = engine.executor.controlnets().root
    other = folder / "wide"
    other.mkdir()
    config = json.loads((folder / "pose" / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 64}))
    (other / "diffusion_pytorch_model.safetensors").write_bytes(
        (folder / "pose" / "diffusion_pytorch_model.safetensors").read_bytes())
    try:
        bad, fine = engine.generate([request(2, (("wide", 1.0, 0.0, 1.0),)), request(3, (("pose", 1.0, 0, 1),))])
    finally:
        import shutil

        shutil.rmtree(other)
    assert not bad.ok and "cross_attention_dim 64" in bad.error and "does not fit" in bad.error
    assert fine.ok


def test_flux_fill_inpainting_refuses_controls_naming_why(engine):
    """Flux.1 inpaints with Flux Fill (mask and masked image as transformer channels): no Flux ControlNet fits it."""
    info = replace(engine.model_info, family="flux", name="tiny-flux-fill", inpaint="channels")
    mask = IMAGE.convert("L")
    with pytest.raises(ValidationError) as err:
        resolve_params(with_controls([{"name": "pose", "image": IMAGE}], image=IMAGE, mask_image=mask), info)
    assert err.value.field == "controls" and "Flux Fill" in str(err.value) and "allowed:" in str(err.value)


def test_controls_with_an_image_on_another_family_are_refused_naming_why(engine):
    """A family whose ControlNets run for text to image, but whose edits were not checked against diffusers."""
    info = replace(engine.model_info, family="sd3", name="tiny-sd3")
    assert resolve_params(with_controls([{"name": "pose", "image": IMAGE}]), info).controls
    with pytest.raises(ValidationError) as err:
        resolve_params(with_controls([{"name": "pose", "image": IMAGE}], image=IMAGE, strength=0.5), info)
    assert err.value.field == "controls" and "no controls with an image" in str(err.value)
