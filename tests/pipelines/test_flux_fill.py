"""Flux Fill: inpainting with a Fill transformer (mask and masked image as extra input channels). A request alone
equals diffusers' FluxFillPipeline for the same seed, strength, guidance and mask (uint8 within 1); mixed in one
batch at different strengths, step counts and guidance, under every strategy, each image is its own; requests
without an image and a mask are refused naming the field."""

import numpy as np
import pytest
from edit_images import assert_each_its_own, mask_image, pixels, start_image
from family_reference import fill_reference

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES

pytestmark = pytest.mark.usefixtures("batching_pays")








@pytest.fixture(scope="module")
def fill_path(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux_fill") / "pipe", fill=True)


def fill(i, strength=None, steps=4, guidance=None):
    return SamplingParams(prompt=f"a red cube {i}", seed=900 + i, num_inference_steps=steps, guidance_scale=guidance,
                          image=start_image(i, 32, vertical=True), mask_image=mask_image(i, 32), strength=strength)


@pytest.mark.parametrize("strength,guidance", [(None, None), (0.6, 3.5)])
def test_alone_equals_diffusers_flux_fill(fill_path, strength, guidance):
    engine = Engine.from_pretrained(str(fill_path), strategy="continuous")
    info = engine.model_info
    assert info.inpaint == "channels" and info.default_guidance_scale == 30.0
    p = fill(1, strength, guidance=guidance)
    got = engine.generate([p])[0]
    assert np.abs(pixels(got.image) - fill_reference(fill_path, p)).max() <= 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mixed_strengths_steps_and_guidance(fill_path, strategy):
    engine = Engine.from_pretrained(str(fill_path), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    reqs = [fill(i, [None, 0.5, 0.75][i % 3], steps=[3, 5][i % 2], guidance=[None, 4.0][i % 2]) for i in range(5)]
    assert_each_its_own(engine, reqs)


def test_a_fill_model_needs_an_image_and_a_mask(fill_path):
    engine = Engine.from_pretrained(str(fill_path), strategy="continuous")
    for change, field in (({"mask_image": None}, "mask_image"),
                          ({"mask_image": None, "image": None, "strength": None}, "image")):
        with pytest.raises(ValidationError) as err:
            engine.generate([SamplingParams(**{**vars(fill(0)), **change})])
        assert err.value.field == field and "inpainting model" in str(err.value)
