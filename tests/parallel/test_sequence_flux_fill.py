"""Tiny Flux Fill (inpainting: the mask and the masked image as input channels) with --ulysses-degree 2 on the CPU:
inpainting requests of mixed strengths, steps and guidance sent together equal diffusers' FluxFillPipeline run
alone (uint8 within 1)."""

import numpy as np
import pytest
from edit_images import mask_image, pixels, start_image
from family_reference import fill_reference
from sequence_cases import split_engine

from stepserve import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batching_pays")]  # two ranks start: seconds


@pytest.fixture(scope="module")
def fill_path(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("flux_fill_sequence") / "pipe", fill=True)


def test_inpainting_requests_equal_diffusers_flux_fill(fill_path):
    reqs = [SamplingParams(prompt=f"a red cube {i}", seed=900 + i, num_inference_steps=[3, 5][i % 2],
                           guidance_scale=[None, 4.0][i % 2], image=start_image(i, 32, vertical=True),
                           mask_image=mask_image(i, 32), strength=[None, 0.5, 0.75][i % 3]) for i in range(4)]
    with split_engine(fill_path) as engine:
        results = engine.generate(reqs)
    assert all(r.ok for r in results), [r.error for r in results]
    assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, p in zip(results, reqs):
        assert np.abs(pixels(r.image) - fill_reference(fill_path, p)).max() <= 1, p
