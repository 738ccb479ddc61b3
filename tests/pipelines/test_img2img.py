"""Image to image: a request that starts from an image joins the running batch at the step its strength skips
to; alone it equals diffusers' StableDiffusionImg2ImgPipeline for the same seed, strength and settings (uint8
within 1), for every sampler; mixed with text-to-image requests and other strengths in one batch, under every
strategy, each image is the one it gets alone. Bad images and strengths fail that request alone."""

import numpy as np
import pytest
import torch
from edit_images import assert_each_its_own, pixels, start_image
from tiny_sd import SCHEDULER_CLASS

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES

pytestmark = pytest.mark.usefixtures("batching_pays")






def reference(path, p: SamplingParams) -> np.ndarray:
    import diffusers

    pipe = diffusers.StableDiffusionImg2ImgPipeline.from_pretrained(path, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = getattr(diffusers, SCHEDULER_CLASS[p.sampler]).from_config(pipe.scheduler.config)
    image = pipe(p.prompt, image=p.image, strength=p.strength, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def edit(i, sampler="dpmpp_2m", strength=0.6, steps=8, guidance=4.0):
    return SamplingParams(prompt=f"a cat {i}", seed=500 + i, num_inference_steps=steps, guidance_scale=guidance,
                          sampler=sampler, image=start_image(i), strength=strength)


@pytest.mark.parametrize("sampler,strength", [("dpmpp_2m", 0.6), ("dpmpp_2m", 1.0), ("euler", 0.5),
                                              ("euler_a", 0.75), ("ddim", 0.3)])
def test_alone_equals_diffusers_img2img(tiny_sd_path, sampler, strength):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous")
    p = edit(1, sampler, strength)
    got = engine.generate([p])[0]
    assert len(got.timing.batch_sizes) == int(8 * strength)  # it ran only the steps its strength leaves
    assert np.abs(pixels(got.image) - reference(tiny_sd_path, p)).max() <= 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_mixed_with_generations_each_image_its_own(tiny_sd_path, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=6, max_queue_delay_ms=1)
    reqs = []
    for i in range(8):
        if i % 3 == 0:
            reqs.append(SamplingParams(prompt=f"a dog {i}", seed=600 + i, num_inference_steps=[6, 8][i % 2],
                                       guidance_scale=4.0, sampler="dpmpp_2m", height=16, width=16))
        else:
            reqs.append(edit(i, ["dpmpp_2m", "euler"][i % 2], [0.3, 0.75, 1.0][i % 3], steps=[6, 8][i % 2]))
    assert_each_its_own(engine, reqs)


@pytest.mark.parametrize("change,field,says", [
    ({"strength": 0.0}, "strength", "must be a number in (0, 1]"),
    ({"strength": 0.05}, "strength", "runs no step"),
    ({"image": "not an image"}, "image", "expected a PIL image"),
    ({"image": None, "strength": 0.5}, "strength", "goes with an image"),
])
def test_bad_edits_name_the_field(tiny_sd_path, change, field, says):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous")
    p = edit(2)
    for k, v in change.items():
        setattr(p, k, v)
    with pytest.raises(ValidationError) as err:
        engine.generate([p])
    assert err.value.field == field and says in str(err.value)


def test_start_images_admitted_together_are_encoded_in_one_vae_pass(tiny_sd_path, monkeypatch):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8)
    vae = engine.executor.pipeline.networks.vae
    rows, encode = [], vae.encode
    monkeypatch.setattr(vae, "encode", lambda pixels, *a, **k: (rows.append(pixels.shape[0]), encode(pixels, *a, **k))[1])
    reqs = [edit(i, strength=s) for i, s in enumerate((0.5, 0.75, 1.0))]
    reqs.append(SamplingParams(prompt="a dog", seed=3, num_inference_steps=8, guidance_scale=4.0, height=16, width=16))
    together = engine.generate(reqs)
    assert rows == [3]  # the three edits' images in one forward of the VAE's encoder; the generation needs none
    monkeypatch.setattr(vae, "encode", encode)
    for p, got in zip(reqs[:3], together):  # and each image is the one diffusers gives it alone
        assert np.abs(pixels(got.image) - reference(tiny_sd_path, p)).max() <= 1
