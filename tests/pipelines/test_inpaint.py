"""Inpainting: a request with an image and a mask alone equals diffusers' StableDiffusionInpaintPipeline (an
inpainting UNet with 9 input channels, and an ordinary SD UNet that blends the known region back) and
StableDiffusionXLInpaintPipeline for the same seed, strength and settings (uint8 within 1); mixed in one batch
with generations, image-to-image requests and other strengths, under every strategy, each image is its own.
Bad masks fail that request alone, naming the field."""

import numpy as np
import pytest
import torch
from edit_images import assert_each_its_own, mask_image, pixels, start_image
from tiny_sd import SCHEDULER_CLASS

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES

pytestmark = pytest.mark.usefixtures("batching_pays")








@pytest.fixture(scope="module")
def inpainting_path(tmp_path_factory):
    from stepserve.tiny.sd import build_tiny_sd

    return build_tiny_sd(tmp_path_factory.mktemp("tiny_inpaint") / "pipe", inpainting=True)


@pytest.fixture(scope="module")
def sdxl_path(tmp_path_factory):
    from stepserve.tiny.sdxl import build_tiny_sdxl

    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl_inpaint") / "pipe")


def reference(path, p: SamplingParams, pipeline="StableDiffusionInpaintPipeline") -> np.ndarray:
    import diffusers

    pipe = getattr(diffusers, pipeline).from_pretrained(path, **({} if "XL" in pipeline else {"safety_checker": None}))
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = getattr(diffusers, SCHEDULER_CLASS[p.sampler]).from_config(pipe.scheduler.config)
    options = {} if p.strength is None else {"strength": p.strength}
    image = pipe(p.prompt, image=p.image, mask_image=p.mask_image, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 height=p.height or 16, width=p.width or 16, output_type="np", **options).images[0]
    return (image * 255).round().astype(np.int16)


def inpaint(i, sampler="dpmpp_2m", strength=1.0, steps=8, guidance=4.0):
    return SamplingParams(prompt=f"a cat {i}", seed=700 + i, num_inference_steps=steps, guidance_scale=guidance,
                          sampler=sampler, image=start_image(i), mask_image=mask_image(i), strength=strength)


CASES = [("dpmpp_2m", 1.0, 4.0), ("euler", 0.6, 4.0), ("euler_a", 1.0, 1.0), ("ddim", 0.5, 3.0)]


@pytest.mark.parametrize("sampler,strength,guidance", CASES)
def test_inpainting_unet_alone_equals_diffusers(inpainting_path, sampler, strength, guidance):
    engine = Engine.from_pretrained(str(inpainting_path), strategy="continuous")
    assert engine.model_info.inpaint == "channels"
    p = inpaint(1, sampler, strength, guidance=guidance)
    got = engine.generate([p])[0]
    assert len(got.timing.batch_sizes) == int(8 * strength)
    assert np.abs(pixels(got.image) - reference(inpainting_path, p)).max() <= 1


@pytest.mark.parametrize("sampler,strength,guidance", CASES)
def test_blending_alone_equals_diffusers(tiny_sd_path, sampler, strength, guidance):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous")
    assert engine.model_info.inpaint == "blend"
    p = inpaint(2, sampler, strength, guidance=guidance)
    got = engine.generate([p])[0]
    want = reference(tiny_sd_path, p)
    assert np.abs(pixels(got.image) - want).max() <= 1
    # and the known region is the image's: outside the mask the result differs from a plain img2img
    plain = engine.generate([SamplingParams(**{**vars(p), "mask_image": None})])[0]
    assert np.abs(pixels(plain.image) - want).max() > 1


@pytest.mark.parametrize("strength", [None, 0.5])
def test_sdxl_blending_alone_equals_diffusers(sdxl_path, strength):
    engine = Engine.from_pretrained(str(sdxl_path), strategy="continuous")
    p = inpaint(3, "euler", strength, steps=6)
    got = engine.generate([p])[0]
    if strength is None:  # the pipeline's own default, 0.9999: one step of 6 skipped
        assert len(got.timing.batch_sizes) == 5
    want = reference(sdxl_path, p, "StableDiffusionXLInpaintPipeline")
    assert np.abs(pixels(got.image) - want).max() <= 1


def test_sdxl_inpainting_unet_alone_equals_diffusers(tmp_path):
    from stepserve.tiny.sdxl import build_tiny_sdxl

    path = build_tiny_sdxl(tmp_path / "pipe", inpainting=True)
    engine = Engine.from_pretrained(str(path), strategy="continuous")
    assert engine.model_info.inpaint == "channels"
    for strength in (None, 0.6):
        p = inpaint(4, "euler", strength, steps=6)
        got = engine.generate([p])[0]
        assert np.abs(pixels(got.image) - reference(path, p, "StableDiffusionXLInpaintPipeline")).max() <= 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mixed_with_generations_and_edits(tiny_sd_path, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=6, max_queue_delay_ms=1)
    reqs = []
    for i in range(9):
        if i % 3 == 0:
            reqs.append(SamplingParams(prompt=f"a dog {i}", seed=600 + i, num_inference_steps=[6, 8][i % 2],
                                       guidance_scale=4.0, sampler="dpmpp_2m", height=16, width=16))
        elif i % 3 == 1:
            reqs.append(inpaint(i, ["dpmpp_2m", "euler_a"][i % 2], [0.5, 1.0][i % 2], steps=[6, 8][i % 2]))
        else:
            reqs.append(SamplingParams(**{**vars(inpaint(i, "euler", 0.75, steps=6)), "mask_image": None}))
    assert_each_its_own(engine, reqs)


@pytest.mark.parametrize("strategy", ["continuous", "dynamic", "slo"])
def test_inpainting_unet_mixed_strengths(inpainting_path, strategy):
    engine = Engine.from_pretrained(str(inpainting_path), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    reqs = [inpaint(i, ["dpmpp_2m", "euler"][i % 2], [1.0, 0.5, 0.75][i % 3], steps=[6, 8][i % 2],
                    guidance=[1.0, 4.0][i % 2]) for i in range(6)]
    assert_each_its_own(engine, reqs)


def test_bad_masks_name_the_field(tiny_sd_path, inpainting_path):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous")
    cases = [({"mask_image": mask_image(0, 8)}, "mask_image", "must match the image's 16x16"),
             ({"image": None, "strength": None}, "mask_image", "goes with an image"),
             ({"mask_image": "no"}, "mask_image", "expected a PIL image")]
    for change, field, says in cases:
        p = SamplingParams(**{**vars(inpaint(0)), **change})
        with pytest.raises(ValidationError) as err:
            engine.generate([p])
        assert err.value.field == field and says in str(err.value)
    model = Engine.from_pretrained(str(inpainting_path), strategy="continuous")
    for change, field in (({"mask_image": None}, "mask_image"), ({"mask_image": None, "image": None,
                                                                   "strength": None}, "image")):
        with pytest.raises(ValidationError) as err:
            model.generate([SamplingParams(**{**vars(inpaint(0)), **change})])
        assert err.value.field == field and "inpainting model" in str(err.value)
