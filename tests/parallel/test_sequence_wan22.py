"""Tiny Wan 2.2 (two experts) with --ulysses-degree 2 on the CPU: both transformers are split over the sequence
ranks (a step's rows may run on either), and videos whose steps cross the experts' boundary, sent together, equal
diffusers' WanPipeline run alone (uint8 within 1)."""

import numpy as np
import pytest
from sequence_cases import as_video, split_engine
from wan_reference import reference_video

from stepserve import SamplingParams
from stepserve.util.shards import sequence_degree

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batching_pays")]  # two ranks start: seconds


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan22_sequence") / "pipe", seed=1, wan22=True)


def mixed(n=6):
    """Step counts whose timesteps cross the boundary at different steps; a video, an image, a taller video."""
    buckets = [(5, 32, 32), (1, 32, 32), (5, 48, 32)]
    return [SamplingParams(prompt=f"a lighthouse {i}", negative_prompt="blurry" if i % 2 else "", seed=90 + i,
                           num_inference_steps=[3, 5, 4][i % 3], guidance_scale=[4.0, 1.0][i % 2],
                           sampler="flow_euler", num_frames=buckets[i % 3][0], height=buckets[i % 3][1],
                           width=buckets[i % 3][2]) for i in range(n)]


def test_both_experts_split_and_videos_equal_diffusers(wan22):
    params = mixed()
    references = [reference_video(wan22, p) for p in params]
    with split_engine(wan22, max_batch_size=8) as engine:
        networks = engine.executor.pipeline.networks
        assert sequence_degree(networks.transformer) == sequence_degree(networks.transformer_2) == 2
        results = engine.generate(params)
    assert all(r.ok for r in results), [r.error for r in results]
    assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, p, ref in zip(results, params, references):
        assert np.abs(as_video(r) - ref).max() <= 1, p
