"""Tiny Wan 2.1 with --ulysses-degree 2 on the CPU (two gloo ranks): diffusers' plan splits a video's tokens (latent
frames x rows x columns of patches; the text is not split) over the ranks. Videos and images of mixed frames,
sizes, steps, samplers and guidance sent together equal diffusers' WanPipeline run alone, frame by frame (uint8
within 1); a request whose tokens do not divide over the ranks is refused naming its size, while the same size
with more frames (more tokens) is served."""

import numpy as np
import pytest
from sequence_cases import as_video, split_engine, with_strategy
from wan_reference import reference_video

from stepserve import SamplingParams, ValidationError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batching_pays")]  # two ranks start: seconds

# (frames, height, width): tokens = ((frames - 1) / 4 + 1) x (height / 16) x (width / 16) -> 8, 4, 12 and 2
BUCKETS = [(5, 32, 32), (1, 32, 32), (5, 48, 32), (5, 16, 16)]


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan_sequence") / "pipe")


@pytest.fixture(scope="module")
def split(wan):
    with split_engine(wan) as engine:
        yield engine


def mixed(n=8):
    return [SamplingParams(prompt=["a red fox", "seven", "zz top at dawn", "blue sky"][i % 4] + f" {i}",
                           negative_prompt="blurry, low quality" if i % 3 == 0 else "", seed=700 + 13 * i,
                           num_inference_steps=[2, 4, 3][i % 3], guidance_scale=[4.0, 1.0, 2.5][i % 3],
                           sampler=("dpmpp_2m", "flow_euler")[(i // 2) % 2], num_frames=BUCKETS[i % 4][0],
                           height=BUCKETS[i % 4][1], width=BUCKETS[i % 4][2]) for i in range(n)]


@pytest.fixture(scope="module")
def references(wan):
    return [reference_video(wan, p) for p in mixed()]


@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_mixed_videos_equal_diffusers_pipeline(split, references, strategy):
    params = mixed()
    results = with_strategy(split, strategy, max_batch_size=8).generate(params)  # slo: 2 slots per bucket
    assert all(r.ok for r in results), [r.error for r in results]
    assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, p, ref in zip(results, params, references):
        assert len(r.frames) == p.num_frames
        assert np.abs(as_video(r) - ref).max() <= 1, p


def test_tokens_that_do_not_split_are_refused_naming_the_size(split):
    with pytest.raises(ValidationError, match="its 1 image tokens do not split over the 2 ranks"):
        split.generate([SamplingParams(prompt="a", num_frames=1, height=16, width=16)])
    served = split.generate([SamplingParams(prompt="a", num_frames=5, height=16, width=16, num_inference_steps=2)])
    assert served[0].ok and len(served[0].frames) == 5  # two latent frames: 2 tokens
