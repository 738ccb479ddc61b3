"""Image to image on SDXL, SD3 and Flux: a request alone equals the family's diffusers img2img pipeline
(StableDiffusionXLImg2ImgPipeline, StableDiffusion3Img2ImgPipeline, FluxImg2ImgPipeline) for the same seed and
strength (uint8 within 1); mixed with generations in one batch, each image is its own; the default strength is
the pipeline's."""

import numpy as np
import pytest
import torch
from PIL import Image

from stepserve import Engine, SamplingParams

pytestmark = pytest.mark.usefixtures("batching_pays")


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def start_image(seed: int, size: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, size)[:, None, None] * np.ones((1, size, 3))
    return Image.fromarray(np.clip(base + rng.normal(0, 30, (size, size, 3)), 0, 255).astype(np.uint8))


def _sdxl(path):
    from stepserve.tiny.sdxl import build_tiny_sdxl

    return build_tiny_sdxl(path)


def _sd3(path):
    from stepserve.tiny.sd3 import build_tiny_sd3

    return build_tiny_sd3(path)


def _flux(path):
    from stepserve.tiny.flux import build_tiny_flux

    return build_tiny_flux(path, variant="dev")


FAMILIES = {  # builder, diffusers img2img pipeline, image size, sampler, guidance, default strength
    "sdxl": (_sdxl, "StableDiffusionXLImg2ImgPipeline", 16, "euler", 4.0, 0.3),
    "sd3": (_sd3, "StableDiffusion3Img2ImgPipeline", 32, "flow_euler", 4.0, 0.6),
    "flux": (_flux, "FluxImg2ImgPipeline", 32, "flow_euler", 3.5, 0.6),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    build, pipeline, size, sampler, guidance, strength = FAMILIES[request.param]
    path = build(tmp_path_factory.mktemp(request.param) / "pipe")
    return path, Engine.from_pretrained(str(path), strategy="continuous", max_batch_size=8), pipeline, size, \
        sampler, guidance, strength


def edit(i, size, sampler, guidance, strength=0.7, steps=6):
    return SamplingParams(prompt=f"a red cube {i}", seed=40 + i, num_inference_steps=steps, guidance_scale=guidance,
                          sampler=sampler, image=start_image(i, size), strength=strength)


def test_alone_equals_the_familys_img2img_pipeline(family):
    import diffusers

    path, engine, pipeline, size, sampler, guidance, _ = family
    p = edit(1, size, sampler, guidance)
    got = engine.generate([p])[0]
    kwargs = {"add_watermarker": False} if "XL" in pipeline else {}
    pipe = getattr(diffusers, pipeline).from_pretrained(path, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    if sampler == "euler":
        pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    want = pipe(p.prompt, image=p.image, strength=p.strength, num_inference_steps=p.num_inference_steps, height=size,
                width=size,
                guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(p.seed),
                output_type="np").images[0]
    from stepserve.request.img2img_spec import first_step

    assert len(got.timing.batch_sizes) == 6 - first_step(6, 0.7, engine.model_info.img2img_start)
    assert np.abs(pixels(got.image) - (want * 255).round().astype(np.int16)).max() <= 1


def test_default_strength_is_the_pipelines(family):
    _, engine, _, size, sampler, guidance, strength = family
    p = edit(2, size, sampler, guidance, steps=10)
    p.strength = None
    assert engine.generate([p])[0].params.strength == strength


def test_mixed_with_generations(family):
    _, engine, _, size, sampler, guidance, _ = family
    reqs = [edit(i, size, sampler, guidance, strength=[0.4, 0.9][i % 2]) if i % 3 else
            SamplingParams(prompt=f"a blue ball {i}", seed=60 + i, num_inference_steps=6, guidance_scale=guidance,
                           sampler=sampler, height=size, width=size) for i in range(6)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
