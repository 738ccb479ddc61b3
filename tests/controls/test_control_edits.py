"""ControlNets on requests with an image: image to image and inpainting (an ordinary UNet that blends the known
region back, and an inpainting UNet whose ControlNet takes the latents alone). A request alone equals the family's
diffusers ControlNet Img2Img / Inpaint pipeline (uint8 within 1; the control's window counts the steps the strength
leaves, as those pipelines count them), and in mixed batches (edits with controls, edits without, text to image
with and without controls), under every strategy, each request gets the image it gets alone."""

import numpy as np
import pytest
from control_reference import build_controlnets, diffusers_controlnet, request
from edit_images import assert_each_its_own, mask_image, pixels, start_image

from stepserve import Engine, SamplingParams, ValidationError
from strategy_params import EVERY_STRATEGY

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    return build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))


@pytest.fixture(scope="module")
def engine(tiny_sd_path, folder):
    return Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                  controlnet_dir=str(folder))


def edit(i, controls=(), strength=0.6, mask=False, **kw) -> SamplingParams:
    p = request(i, controls, **kw)
    p.image, p.strength = start_image(i), strength
    p.mask_image = mask_image(i) if mask else None
    return p


CASES = [  # (controls, strength, guidance, mask)
    ((("pose", 1.0, 0.0, 1.0),), 0.6, 4.0, False),
    ((("depth", 0.9, 0.2, 0.8),), 0.75, 1.0, False),
    ((("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.3, 1.0)), 1.0, 4.0, False),
    ((("pose", 1.0, 0.0, 1.0),), 1.0, 4.0, True),
    ((("edge", 0.7, 0.0, 0.6), ("pose", 1.0, 0.4, 1.0)), 0.5, 3.0, True),
]


def check_alone(engine, path, folder, p, family="sd"):
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_controlnet(path, folder, p, family)).max() <= 1
    plain = engine.generate([SamplingParams(**{**vars(p), "controls": []})])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 4  # the control did change the image


@pytest.mark.parametrize("case", range(len(CASES)))
def test_alone_equals_the_diffusers_controlnet_edit_pipelines(engine, tiny_sd_path, folder, case):
    controls, strength, guidance, mask = CASES[case]
    check_alone(engine, tiny_sd_path, folder, edit(case, controls, strength, mask, guidance=guidance, steps=8))


def test_an_inpainting_unet_with_controls_equals_diffusers(tmp_path):
    """A 9-channel inpainting UNet: its ControlNet takes the 4-channel latents, not the UNet's input."""
    from stepserve.tiny.sd import build_tiny_sd

    path = build_tiny_sd(tmp_path / "pipe", inpainting=True)
    nets = build_controlnets(path, tmp_path / "controlnets")
    engine = Engine.from_pretrained(str(path), strategy="continuous", controlnet_dir=str(nets))
    assert engine.model_info.inpaint == "channels"
    for i, strength in enumerate((1.0, 0.6)):
        check_alone(engine, path, nets, edit(40 + i, (("pose", 1.0, 0.0, 0.8),), strength, mask=True, steps=6))
    controls = [(("pose", 1.0, 0.0, 1.0),), (), (("depth", 0.7, 0.2, 1.0), ("pose", 0.5, 0.0, 0.5)), ()]
    reqs = [edit(45 + i, controls[i], [1.0, 0.6][i % 2], mask=True, steps=[6, 5][i % 2],
                 guidance=[4.0, 1.0][i // 2]) for i in range(4)]
    assert_each_its_own(Engine.from_pretrained(str(path), strategy="continuous", max_batch_size=4,
                                               controlnet_dir=str(nets)), reqs)


def mixed():
    controls = [(("pose", 1.0, 0.0, 1.0),), (), (("depth", 0.6, 0.3, 1.0),),
                (("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.25, 1.0)), (("edge", 1.0, 0.5, 1.0),), ()]
    out = []
    for i in range(9):
        kw = {"guidance": [4.0, 1.0, 6.0][i % 3], "steps": [6, 8][i % 2]}
        if i % 3 == 2:  # text to image, with and without controls
            out.append(request(20 + i, controls[i % 6], **kw))
        else:  # image to image and inpainting, with and without controls, at different strengths
            out.append(edit(20 + i, controls[i % 6], [0.5, 0.75, 1.0][i % 3], mask=i % 4 == 1, **kw))
    return out


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image(tiny_sd_path, folder, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=6, max_queue_delay_ms=1,
                                    controlnet_dir=str(folder))
    reqs = mixed()
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert all(r.ok for r in together), [r.error for r in together]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_the_window_counts_the_steps_the_strength_leaves(engine, monkeypatch):
    """At strength 0.5 of 8 steps the request runs 4; a control with end 0.5 applies to the first 2 of them."""
    store = engine.executor.controlnets()
    ran, ensure = [], store.ensure

    def counted(net):
        def run(*args, **kwargs):
            ran.append(1)
            return net(*args, **kwargs)
        return run

    monkeypatch.setattr(store, "ensure",
                        lambda names, **kw: {n: counted(m) for n, m in ensure(names, **kw).items()})
    got = engine.generate([edit(50, (("pose", 1.0, 0.0, 0.5),), 0.5, steps=8, guidance=1.0)])[0]
    assert got.ok and len(got.timing.batch_sizes) == 4
    assert len(ran) == 2
