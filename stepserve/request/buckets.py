"""Shape buckets: requests of one shape bucket share a denoising forward. An image model's bucket is (height,
width); a video model's is (frames, height, width) for every request (frames 1: a still image). Whatever derives a
size or a cost from a bucket goes through these helpers, so that a video counts its frames.

Plain data, no torch: the scheduling and cost layers use them.
"""

from __future__ import annotations

from typing import Any

Bucket = tuple[int, ...]  # (height, width), or (frames, height, width) on a video model


def bucket_of(params: Any) -> Bucket:  # resolved SamplingParams (types.py imports this module)
    """The shape bucket of resolved params: (frames, height, width) when num_frames is set (a video model), else
    (height, width)."""
    if params.num_frames is None:
        return (params.height, params.width)
    return (params.num_frames, params.height, params.width)


def bucket_frames(bucket: Bucket) -> int:
    return bucket[0] if len(bucket) == 3 else 1


def bucket_size(bucket: Bucket) -> tuple[int, int]:
    """(height, width) of a bucket."""
    return (bucket[-2], bucket[-1])


def bucket_pixels(bucket: Bucket) -> int:
    """Pixels a request of the bucket makes: height x width, times its frames for a video bucket. The costs of an
    unmeasured bucket scale with it (a video VAE compresses frames in time as well, so a video's latents grow
    more slowly than its frames: counting every frame is the conservative choice)."""
    h, w = bucket_size(bucket)
    return h * w if len(bucket) == 2 else bucket[0] * h * w


def bucket_name(bucket: Bucket) -> str:
    """'WxH' (as the HTTP API's "size"), with 'xF' appended for a video bucket's frames ('64x32x17')."""
    h, w = bucket_size(bucket)
    return f"{w}x{h}" if len(bucket) == 2 else f"{w}x{h}x{bucket[0]}"


def bucket_fields(bucket: Bucket) -> dict[str, int]:
    """The SamplingParams fields that make a request of the bucket (height, width, and num_frames for video)."""
    h, w = bucket_size(bucket)
    return {"height": h, "width": w} if len(bucket) == 2 else {"height": h, "width": w, "num_frames": bucket[0]}


def is_bucket(value: Any) -> bool:
    """(height, width) or (frames, height, width) in positive integers."""
    return (isinstance(value, (list, tuple)) and len(value) in (2, 3)
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value))


def default_bucket(model: Any) -> Bucket:  # a ModelInfo
    """The bucket of a request with the model's defaults (a video model: its default frames)."""
    size = (model.default_height, model.default_width)
    return (model.default_frames, *size) if model.video else size


def largest_bucket(model: Any) -> Bucket:  # a ModelInfo
    """The costliest bucket the model serves: max_size square, with max_frames on a video model."""
    size = (model.max_size, model.max_size)
    return (model.max_frames, *size) if model.video else size
