"""Shape buckets with frames: a video model's requests are bucketed by (frames, height, width), and whatever derives
a size or a cost from a bucket counts the frames (the latency model's scaling, the fake executor's charges, the
memory cap's probe); an image model's buckets stay (height, width) with unchanged costs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stepserve.costs.cost_model import CostModel
from stepserve.costs.latency_model import Curve, LatencyModel
from stepserve.request.buckets import (bucket_fields, bucket_name, bucket_of, bucket_pixels, default_bucket,
                               largest_bucket)
from stepserve.request.types import ModelInfo, Request
from stepserve.request.validation import ValidationError, resolve_params

IMAGE = ModelInfo(name="m", default_sampler="ddim", default_steps=4, default_guidance_scale=1.0, default_height=32,
                  default_width=48, size_multiple=16, min_size=16, max_size=64)
VIDEO = replace(IMAGE, max_frames=9, frame_step=4, default_frames=5, family="wan")


def test_buckets_carry_frames_on_a_video_model_only():
    image = resolve_params(_params(), IMAGE)
    assert image.num_frames is None and bucket_of(image) == (32, 48)
    still = resolve_params(_params(), VIDEO)  # no num_frames: one frame, an image
    assert bucket_of(still) == (1, 32, 48)
    video = resolve_params(_params(num_frames=9, height=64), VIDEO)
    assert bucket_of(video) == (9, 64, 48)
    assert (bucket_pixels((32, 48)), bucket_pixels((1, 32, 48)), bucket_pixels((9, 64, 48))) == (1536, 1536, 27648)
    assert (bucket_name((32, 48)), bucket_name((9, 64, 48))) == ("48x32", "48x64x9")
    assert bucket_fields((9, 64, 48)) == {"height": 64, "width": 48, "num_frames": 9}
    assert (default_bucket(IMAGE), default_bucket(VIDEO)) == ((32, 48), (5, 32, 48))
    assert (largest_bucket(IMAGE), largest_bucket(VIDEO)) == ((64, 64), (9, 64, 64))
    with pytest.raises(ValidationError, match="num_frames: m .* makes images, not videos"):
        resolve_params(_params(num_frames=5), IMAGE)


def test_an_unmeasured_video_bucket_costs_its_frames():
    model = LatencyModel(step={(32, 32): Curve(((1, 0.1), (2, 0.15)))}, encode=Curve(((1, 0.01),)),
                         decode={(1, 32, 32): Curve(((1, 0.02),))})
    assert model.step_s(2, (5, 32, 32)) == pytest.approx(5 * 0.15)  # 5 frames: 5 times the pixels
    assert model.step_s(2, (64, 32)) == pytest.approx(2 * 0.15)  # an image bucket as before
    assert model.decode_s(1, (9, 32, 32)) == pytest.approx(9 * 0.02)
    assert LatencyModel.from_dict(model.to_dict()).decode == model.decode  # a video bucket survives the file
    cost = CostModel()
    one = Request("a", resolve_params(_params(), VIDEO), 0.0, (1, 32, 32), 4)
    five = Request("b", resolve_params(_params(num_frames=5), VIDEO), 0.0, (5, 32, 32), 4)
    per_item = [cost.decode_s([r]) - cost.decode_fixed_s for r in (one, five)]
    assert per_item[1] == pytest.approx(5 * per_item[0])


def test_the_memory_cap_probes_the_longest_video(tmp_path):
    from stepserve.engine.loading import load_executor
    from stepserve.profiling import cap_max_batch_size
    from stepserve.tiny.wan import build_tiny_wan

    executor = load_executor(str(build_tiny_wan(tmp_path / "wan")))
    cap, why = cap_max_batch_size(executor, 2)
    assert cap == 2 and "64x64x9" in why, why


def test_profile_sizes_take_frames():
    from stepserve.commands.profile import build_parser

    args = build_parser().parse_args(["--model", "x", "--out", "o.json", "--sizes", "32x48,64x32x17"])
    assert args.sizes == [(48, 32), (17, 32, 64)]


def _params(**fields):
    from stepserve.request.types import SamplingParams

    return SamplingParams(prompt="a", seed=1, **fields)
