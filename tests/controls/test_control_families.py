"""ControlNets per request on SDXL, SD3 and Flux.1: a request alone equals the family's diffusers ControlNet pipeline
(StableDiffusionXLControlNetPipeline, StableDiffusion3ControlNetPipeline, FluxControlNetPipeline; two ControlNets as
its Multi model sums them), uint8
within 1, and in mixed batches (different ControlNets, two, none, different windows, guidance on and off), under
every strategy, each image is the one it gets alone. A ControlNet of another family is refused naming why."""

import re

import numpy as np
import pytest
from control_reference import build_controlnets, diffusers_controlnet, request
from edit_images import pixels

from stepserve import Engine
from stepserve.controls.errors import ControlNetError
from strategy_params import EVERY_STRATEGY

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

FAMILIES = {"sdxl": {"sampler": "dpmpp_2m"}, "sd3": {"sampler": "flow_euler"}, "flux": {"sampler": "flow_euler"},
            "qwenimage": {"sampler": "flow_euler", "negative_prompt": "blurry"}}  # true CFG with a negative prompt


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, its tiny pipeline folder, its ControlNet folder)."""
    import importlib
    import shutil

    name = request.param
    root = tmp_path_factory.mktemp(f"control_{name}")
    pipe = getattr(importlib.import_module(f"stepserve.tiny.{name}"), f"build_tiny_{name}")(root / "pipe")
    folder = build_controlnets(pipe, root / "controlnets")
    shutil.copytree(folder / "pose", folder / "twin")  # Qwen-Image's pipeline runs one ControlNet on two images
    return name, pipe, folder


def ask(family, i, controls=(), **kw):
    return request(i, controls, **{**FAMILIES[family[0]], **kw})


@pytest.fixture(scope="module")
def engine(family):
    return Engine.from_pretrained(str(family[1]), strategy="continuous", max_batch_size=8,
                                  controlnet_dir=str(family[2]))


CASES = [
    ((("pose", 1.0, 0.0, 1.0),), 5.0),
    ((("depth", 0.9, 0.1, 0.9),), 1.0),
    ((("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.3, 1.0)), 5.0),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_alone_equals_the_diffusers_controlnet_pipeline(family, engine, case):
    controls, guidance = CASES[case]
    if family[0] == "qwenimage" and len(controls) > 1:
        controls = (controls[0], ("twin", *controls[1][1:]))
    p = ask(family, case, controls, guidance=guidance)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_controlnet(family[1], family[2], p, family[0])).max() <= 1
    plain = engine.generate([ask(family, case, (), guidance=guidance)])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 4  # the control did change the image


def mixed(family):
    controls = [(), (("pose", 1.0, 0.0, 1.0),), (("depth", 0.6, 0.3, 1.0),),
                (("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.25, 1.0)), (("edge", 1.0, 0.5, 1.0), ("pose", 0.5, 0, 1))]
    return [ask(family, 20 + i, controls[i], guidance=[5.0, 1.0, 6.0][i % 3], steps=[4, 5][i % 2]) for i in range(5)]


@pytest.fixture(scope="module")
def alone(family, engine):
    return [engine.generate([p])[0] for p in mixed(family)]


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image(family, alone, strategy):
    engine = Engine.from_pretrained(str(family[1]), strategy=strategy, max_batch_size=5, max_queue_delay_ms=1,
                                    controlnet_dir=str(family[2]))
    together = engine.generate(mixed(family))
    assert all(r.ok for r in together), [r.error for r in together]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_a_controlnet_of_another_family_is_refused_naming_why(family, engine, tiny_sd_path, tmp_path):
    from stepserve.tiny.controlnet import build_tiny_controlnet

    store = engine.executor.controlnets()
    build_tiny_controlnet(tiny_sd_path, store.root / "sd_pose")
    try:
        with pytest.raises(ControlNetError, match="does not fit") as err:
            store.ensure(["sd_pose"])
        assert family[0] in str(err.value) and "allowed: ControlNets made for this model" in str(err.value)
        assert "sd_pose" not in store.loaded
    finally:
        import shutil

        shutil.rmtree(store.root / "sd_pose")


@pytest.mark.parametrize("family", ["sdxl", "flux", "qwenimage"], indirect=True)  # the families that cache steps
def test_cached_rows_and_control_rows_share_a_forward(family, engine):
    """Rows that cache steps (fbcache) beside rows with controls: each image is its own alone, and the cached rows
    still skip work."""
    cache = {"policy": "fbcache", "threshold": 2.0 if family[0] == "qwenimage" else 0.5}  # tests/caching's values
    reqs = [ask(family, 30, (), cache=cache),
            ask(family, 31, (("pose", 1.0, 0.0, 1.0),)),
            ask(family, 32, (), cache=cache, guidance=1.0),
            ask(family, 33, (("depth", 0.8, 0.0, 1.0), ("pose", 0.6, 0.2, 1.0)), guidance=1.0)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert all(r.ok for r in together), [r.error for r in together]
    assert max(together[0].timing.batch_sizes) == 4
    assert together[0].timing.cached_steps > 0
    for a, b in zip(alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


@pytest.mark.parametrize("family", ["flux", "qwenimage"], indirect=True)
def test_controlnets_of_different_depths(family, engine):
    """Two ControlNets whose outputs cannot be summed (different depths): a request naming both fails alone,
    saying why; requests each using one of them in the same batch still get their own images."""
    from stepserve.tiny.controlnet import build_tiny_controlnet

    store = engine.executor.controlnets()
    build_tiny_controlnet(family[1], store.root / "deep", seed=9, std=0.05,
                          depth=(1, 2) if family[0] == "flux" else (1,))
    try:
        both, fine = engine.generate([ask(family, 60, (("pose", 1.0, 0.0, 1.0), ("deep", 1.0, 0.0, 1.0)), steps=3),
                                      ask(family, 61, (("pose", 1.0, 0.0, 1.0),), steps=3)])
        assert not both.ok and "different numbers of block outputs" in both.error and "deep" in both.error
        assert isinstance(both.cause, ControlNetError) and both.cause.param == "controls"  # HTTP: a 400, not a 500
        assert fine.ok
        reqs = [ask(family, 62, (("pose", 1.0, 0.0, 1.0),), steps=3), ask(family, 63, (("deep", 0.8, 0, 1),), steps=3)]
        alone = [engine.generate([p])[0] for p in reqs]
        together = engine.generate(reqs)
        assert all(r.ok for r in together), [r.error for r in together]
        for a, b in zip(alone, together):
            assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
    finally:
        import shutil

        shutil.rmtree(store.root / "deep")


WEIGHTS = "diffusion_pytorch_model.safetensors"


def with_config(store, name, **changes):
    """A copy of the served ControlNet "pose" as `name`, its config changed."""
    import json
    import shutil

    folder = store.root / name
    shutil.copytree(store.root / "pose", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("family,key,value,says", [
    ("flux", "num_mode", 10, "union ControlNet"), ("flux", "conditioning_embedding_channels", 16, "input hint block"),
    ("sd3", "use_pos_embed", False, "shares the transformer's position embedding"),
    ("sd3", "joint_attention_dim", None, "takes no text"),
    ("sd3", "extra_conditioning_channels", 1, "takes 1 extra conditioning channels"),
    ("sd3", "num_attention_heads", 2, "its width 16 is not the transformer's 32"),
    ("sd3", "pos_embed_max_size", 16, "covers 16 patches a side, the transformer's 32"),
    ("qwenimage", "extra_condition_channels", 4, "takes 4 extra condition channels"),
    ("qwenimage", "num_attention_heads", 1, "its width 16 is not the transformer's 32"),
    ("qwenimage", "axes_dims_rope", [4, 6, 6], "its axes_dims_rope [4, 6, 6] is not the transformer's [8, 4, 4]"),
], indirect=["family"])
def test_controlnets_not_served_are_refused_naming_why(family, engine, key, value, says):
    import shutil

    store = engine.executor.controlnets()
    folder = with_config(store, "odd", **{key: value})
    try:
        with pytest.raises(ControlNetError, match=re.escape(says)):
            store.ensure(["odd"])
        assert "odd" not in store.loaded
    finally:
        shutil.rmtree(folder)


def test_each_controlnet_runs_once_per_step_on_its_rows(family, monkeypatch):
    engine = Engine.from_pretrained(str(family[1]), strategy="static", static_batch_size=3, max_batch_size=3,
                                    controlnet_dir=str(family[2]))
    store = engine.executor.controlnets()
    seen: dict[str, list[int]] = {}
    ensure = store.ensure

    def counted(net, name):
        def run(*args, **kwargs):
            sample = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            seen.setdefault(name, []).append(sample.shape[0])
            return net(*args, **kwargs)
        run.config = net.config  # what a family reads of its ControlNet (SD3: force_zeros_for_pooled_projection)
        return run

    monkeypatch.setattr(store, "ensure",
                        lambda names, **kw: {n: counted(m, n) for n, m in ensure(names, **kw).items()})
    # a guided request's ControlNet runs on its two rows; Flux has one row per request, and Qwen-Image's
    # unconditional row takes its conditional row's outputs
    guided = 1 if family[0] in ("flux", "qwenimage") else 2
    results = engine.generate([ask(family, 70, (), steps=4), ask(family, 71, (("pose", 1.0, 0.0, 1.0),), steps=4),
                               ask(family, 72, (("pose", 0.5, 0.0, 1.0), ("depth", 1.0, 0.0, 0.5)), steps=4,
                                   guidance=1.0)])
    assert all(r.timing.batch_sizes == [3] * 4 for r in results)  # one batch of three, four steps
    assert seen == {"pose": [guided + 1] * 4, "depth": [1] * 2}  # depth: the first half of the schedule only
    seen.clear()
    engine.generate([ask(family, 73, (), steps=2), ask(family, 74, (), steps=2, guidance=1.0)])
    assert seen == {}  # a batch without controls runs no ControlNet


@pytest.mark.parametrize("family", ["flux"], indirect=True)
def test_flux_refuses_guess_mode_naming_the_field(family, engine):
    from stepserve import ValidationError

    p = ask(family, 80, (("pose", 1.0, 0.0, 1.0), ("depth", 1.0, 0.0, 1.0)), steps=3)
    p.controls[1]["guess_mode"] = True
    with pytest.raises(ValidationError) as err:
        engine.generate([p])
    assert err.value.field == "controls[1].guess_mode"
    assert "flux ControlNets have no guess mode" in str(err.value) and "allowed: no guess_mode" in str(err.value)


@pytest.mark.parametrize("family", ["sd3"], indirect=True)
def test_sd3_controlnet_that_takes_the_pooled_text(family, engine):
    """force_zeros_for_pooled_projection false: the ControlNet takes the row's pooled projections and the control
    latents shifted by the VAE's shift_factor, as the pipeline gives them; alone and in a batch with the default
    kind, each image is the pipeline's / its own."""
    import shutil

    from safetensors.torch import load_file, save_file

    store = engine.executor.controlnets()
    weights = with_config(store, "pooled", force_zeros_for_pooled_projection=False) / WEIGHTS
    state = load_file(weights)  # the image's patches weigh more, so that their shift shows in the image
    save_file({k: v * 20 if k.startswith("pos_embed_input.") else v for k, v in state.items()}, weights)
    try:
        p = ask(family, 80, (("pooled", 1.0, 0.0, 1.0),), guidance=5.0, steps=4)
        got = engine.generate([p])[0]
        assert got.ok, got.error
        assert np.abs(pixels(got.image) - diffusers_controlnet(family[1], family[2], p, "sd3")).max() <= 1
        same = engine.generate([ask(family, 80, (("pose", 1.0, 0.0, 1.0),), guidance=5.0, steps=4)])[0]
        assert np.abs(pixels(got.image) - pixels(same.image)).max() > 0  # the same weights, taken otherwise
        reqs = [p, ask(family, 81, (("pose", 0.7, 0.0, 1.0), ("pooled", 1.0, 0.2, 1.0)), guidance=1.0, steps=4)]
        alone = [engine.generate([r])[0] for r in reqs]
        together = engine.generate(reqs)
        assert max(together[0].timing.batch_sizes) == 2
        for a, b in zip(alone, together):
            assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
    finally:
        shutil.rmtree(store.root / "pooled")


def test_sd35_controlnets_equal_the_pipeline(tmp_path):
    """SD3.5's transformer (RMS-normed query/key, a dual-attention first layer): its ControlNets take the same
    layers; one and two ControlNets, guided and not, alone equal StableDiffusion3ControlNetPipeline."""
    from stepserve.tiny.sd3 import build_tiny_sd3

    pipe = build_tiny_sd3(tmp_path / "pipe", variant="sd3.5")
    folder = build_controlnets(pipe, tmp_path / "controlnets")
    engine = Engine.from_pretrained(str(pipe), controlnet_dir=str(folder))
    for i, (controls, guidance) in enumerate([CASES[0], ((("pose", 0.8, 0, 0.5), ("depth", 1.2, 0.3, 1.0)), 1.0)]):
        p = request(90 + i, controls, guidance=guidance, sampler="flow_euler", steps=4)
        got = engine.generate([p])[0]
        assert got.ok, got.error
        assert np.abs(pixels(got.image) - diffusers_controlnet(pipe, folder, p, "sd3")).max() <= 1
