"""ControlNets on requests with an image for SDXL (image to image, inpainting) and Flux.1 (image to image): a
request alone equals StableDiffusionXLControlNetImg2ImgPipeline / StableDiffusionXLControlNetInpaintPipeline /
FluxControlNetImg2ImgPipeline (uint8 within 1; Flux.1 samples the control image's latents before the start
image's, as its pipeline does), and in mixed batches, under every strategy, each request gets its own image."""

import numpy as np
import pytest
from control_reference import build_controlnets, diffusers_controlnet, request
from edit_images import mask_image, pixels, start_image

from stepserve import Engine, SamplingParams
from stepserve.request.validation import ValidationError
from strategy_params import EVERY_STRATEGY

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

FAMILIES = {"sdxl": {"sampler": "dpmpp_2m"}, "flux": {"sampler": "flow_euler"}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, its tiny pipeline folder, its ControlNet folder)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"control_edit_{name}")
    if name == "sdxl":
        from stepserve.tiny.sdxl import build_tiny_sdxl

        pipe = build_tiny_sdxl(root / "pipe")
    else:
        from stepserve.tiny.flux import build_tiny_flux

        pipe = build_tiny_flux(root / "pipe")
    return name, pipe, build_controlnets(pipe, root / "controlnets")


@pytest.fixture(scope="module")
def engine(family):
    return Engine.from_pretrained(str(family[1]), strategy="continuous", max_batch_size=8,
                                  controlnet_dir=str(family[2]))


def ask(family, i, controls=(), strength=None, mask=False, **kw) -> SamplingParams:
    p = request(i, controls, **{**FAMILIES[family[0]], **kw})
    if strength is not None:
        p.image, p.strength = start_image(i), strength
        p.mask_image = mask_image(i) if mask else None
    return p


CASES = [  # (controls, strength, guidance, mask); Flux.1 inpaints only with Flux Fill, which no ControlNet fits
    ((("pose", 1.0, 0.0, 1.0),), 0.6, 5.0, False),
    ((("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.3, 1.0)), 0.8, 1.0, False),
    ((("depth", 1.0, 0.0, 0.7),), 0.9999, 5.0, True),
    ((("pose", 0.9, 0.2, 1.0),), 0.5, 1.0, True),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_alone_equals_the_diffusers_controlnet_edit_pipelines(family, engine, case):
    controls, strength, guidance, mask = CASES[case]
    p = ask(family, case, controls, strength, mask, guidance=guidance, steps=6)
    if mask and family[0] == "flux":  # Flux.1 inpaints with Flux Fill only (no Flux.1 ControlNet fits it)
        with pytest.raises(ValidationError, match="does not inpaint here"):
            engine.generate([p])
        return
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_controlnet(family[1], family[2], p, family[0])).max() <= 1
    plain = engine.generate([SamplingParams(**{**vars(p), "controls": []})])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 4  # the control did change the image


def mixed(family):
    controls = [(("pose", 1.0, 0.0, 1.0),), (), (("depth", 0.6, 0.3, 1.0),), (("pose", 0.8, 0.0, 0.5),
                ("depth", 1.2, 0.25, 1.0)), ()]
    out = []
    for i in range(5):
        kw = {"guidance": [5.0, 1.0, 6.0][i % 3], "steps": [4, 5][i % 2]}
        if i % 3 == 2:  # text to image with controls
            out.append(ask(family, 20 + i, controls[i], **kw))
        else:  # edits with and without controls (SDXL: one inpainting)
            out.append(ask(family, 20 + i, controls[i], [0.6, 0.9][i % 2], family[0] == "sdxl" and i == 3, **kw))
    return out


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
