"""Image prompts on requests with an image: image to image and inpainting (an ordinary UNet that blends the known
region back, and a 9-channel inpainting UNet), SD 1/2 and SDXL. A request alone equals the family's diffusers
Img2Img / Inpaint pipeline with load_ip_adapter and set_ip_adapter_scale (uint8 within 1), and in mixed batches
(edits with image prompts, edits without, text to image with and without, a ControlNet edit), under every strategy,
each request gets the image it gets alone."""

import numpy as np
import pytest
from control_reference import build_controlnets
from edit_images import assert_each_its_own, mask_image, pixels, start_image
from ip_adapter_reference import build_ip_adapters, diffusers_ip_adapter, request

from stepserve import Engine, SamplingParams
from strategy_params import EVERY_STRATEGY

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    return build_ip_adapters(tiny_sd_path, tmp_path_factory.mktemp("ip_adapters"), std=0.2)


@pytest.fixture(scope="module")
def engine(tiny_sd_path, folder):
    return Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                  ip_adapter_dir=str(folder))


def edit(i, name=None, scale=1.0, strength=0.6, mask=False, **kw):
    p = request(i, name, scale, **kw)
    p.image, p.strength = start_image(i), strength
    p.mask_image = mask_image(i) if mask else None
    return p


def check_alone(engine, path, folder, p, family="sd"):
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_ip_adapter(path, folder, p, family)).max() <= 1
    plain = engine.generate([SamplingParams(**{**vars(p), "ip_adapter": None})])[0]
    assert plain.ok and np.abs(pixels(got.image) - pixels(plain.image)).max() > 4  # the image prompt changed it


CASES = [  # (scale, strength, guidance, mask)
    (1.0, 0.6, 4.0, False),
    (0.7, 0.75, 1.0, False),
    (1.0, 1.0, 4.0, True),
    (0.5, 0.5, 3.0, True),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_alone_equals_diffusers_img2img_and_inpaint_with_ip_adapter(engine, tiny_sd_path, folder, case):
    scale, strength, guidance, mask = CASES[case]
    check_alone(engine, tiny_sd_path, folder, edit(case + 1, "face", scale, strength, mask, guidance=guidance,
                                                   steps=8))


def test_an_inpainting_unet_with_an_image_prompt_equals_diffusers(tmp_path):
    from stepserve.tiny.sd import build_tiny_sd

    path = build_tiny_sd(tmp_path / "pipe", inpainting=True)
    folder = build_ip_adapters(path, tmp_path / "ip_adapters", std=0.2)
    engine = Engine.from_pretrained(str(path), strategy="continuous", max_batch_size=4, ip_adapter_dir=str(folder))
    assert engine.model_info.inpaint == "channels"
    for i, strength in enumerate((1.0, 0.6)):
        check_alone(engine, path, folder, edit(40 + i, "face", 0.8, strength, mask=True, steps=6))
    reqs = [edit(45 + i, [None, "face"][i % 2], 1.0 - 0.3 * i, [1.0, 0.6][i // 2], mask=True, steps=[6, 5][i % 2],
                 guidance=[4.0, 1.0][i // 2]) for i in range(4)]
    assert_each_its_own(engine, reqs)


def test_sdxl_image_to_image_and_inpainting_with_an_image_prompt_equal_diffusers(tmp_path):
    from stepserve.tiny.sdxl import build_tiny_sdxl

    path = build_tiny_sdxl(tmp_path / "pipe")
    folder = build_ip_adapters(path, tmp_path / "ip_adapters", std=0.2)
    engine = Engine.from_pretrained(str(path), strategy="continuous", max_batch_size=4, ip_adapter_dir=str(folder))
    for i, (strength, mask, guidance) in enumerate(((0.6, False, 5.0), (1.0, True, 5.0), (0.7, True, 1.0))):
        check_alone(engine, path, folder, edit(50 + i, "face", 0.8, strength, mask, guidance=guidance, steps=6),
                    "sdxl")
    reqs = [edit(55, "face", 1.0, 0.6), edit(56, None, strength=0.8, mask=True), request(57, "face", 0.5),
            edit(58, "face", 0.7, 1.0, mask=True, guidance=1.0)]
    assert_each_its_own(engine, reqs)


def mixed():
    out = []
    for i in range(8):
        name, kw = [None, "face"][i % 2 if i < 6 else 1], {"guidance": [4.0, 1.0, 6.0][i % 3], "steps": [6, 8][i % 2]}
        if i % 3 == 2:  # text to image, with and without an image prompt
            out.append(request(20 + i, name, [1.0, 0.4][i % 2], **kw))
        else:  # image to image and inpainting, with and without one, at different strengths and scales
            out.append(edit(20 + i, name, [1.0, 0.4, 1.3][i % 3], [0.5, 0.75, 1.0][i % 3], mask=i % 4 == 1, **kw))
    out[4].controls = [{"name": "pose", "image": start_image(92), "scale": 0.8}]  # an edit with both
    return out


@pytest.fixture(scope="module")
def controlnets(tiny_sd_path, tmp_path_factory):
    return build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image(tiny_sd_path, folder, controlnets, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=6, max_queue_delay_ms=1,
                                    ip_adapter_dir=str(folder), controlnet_dir=str(controlnets))
    reqs = mixed()
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert all(r.ok for r in together), [r.error for r in together]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
