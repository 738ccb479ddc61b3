"""The size the memory probe runs at, and how its peaks scale to the size it stands for.

The memory cap is about the costliest bucket a model serves (max_size square, 1024x1024 or more), but running that
through the denoiser and the VAE at batch sizes 1, 2 and 4 on a CPU takes minutes (a tiny random Flux.1: 126 s of
a 130 s start-up, nearly all of it decoding). Activations grow with the tokens, i.e. with the pixels, so the probe
runs a bucket of the same aspect at about PROBE_PIXELS, plus one batch at a quarter of that, and scales each peak
to the real bucket by the growth it saw between the two (at least linear in the pixels, at most quadratic, as
attention that keeps its scores would grow). A tiny random Flux.1 served up to 512x512, on a busy 2-core CPU: the
peak at batch 4 scaled from 256x256, 257.8 MiB in 23.5 s; measured at 512x512 itself, 257.0 MiB in 119 s.
Plain arithmetic on buckets: no torch, no clock.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from ..request.buckets import Bucket, bucket_pixels, bucket_size

PROBE_PIXELS = 256 * 256  # per frame: the largest image the probe runs through the model; larger ones are scaled
MIN_GROWTH, MAX_GROWTH = 1.0, 2.0  # the peak grows with pixels**k: k at least linear, at most quadratic


class ProbePlan(NamedTuple):
    """`target`: the bucket the cap is about; `small`: the bucket measured at every batch size; `smaller`: the one
    measured once (batch 1) to see how the peak grows with the pixels, or None when `small` is `target` (measured
    as it is) or no smaller size exists."""

    target: Bucket
    small: Bucket
    smaller: Bucket | None


def probe_plan(model: Any, target: Bucket) -> ProbePlan:  # a ModelInfo
    """Where to measure `target`: itself when its frame is at most PROBE_PIXELS, else the same aspect scaled to
    about PROBE_PIXELS (and a quarter of that), each side a multiple of the model's size_multiple, at least its
    min_size. A video bucket keeps its frames."""
    height, width = bucket_size(target)
    if height * width <= PROBE_PIXELS:
        return ProbePlan(target, target, None)
    small = _scaled(model, target, math.sqrt(PROBE_PIXELS / (height * width)))
    smaller = _scaled(model, target, math.sqrt(PROBE_PIXELS / (height * width)) / 2)
    return ProbePlan(target, small, None if bucket_pixels(smaller) >= bucket_pixels(small) else smaller)


def _scaled(model: Any, bucket: Bucket, factor: float) -> Bucket:
    step, low = model.size_multiple, model.min_size
    height, width = (max(low, step, int(side * factor) // step * step) for side in bucket_size(bucket))
    return (*bucket[:-2], height, width)


def growth(plan: ProbePlan, peak_small: float, peak_smaller: float | None) -> float:
    """k of peak ~ pixels**k from batch 1's peaks at the two probe sizes, within [MIN_GROWTH, MAX_GROWTH]; linear
    without a smaller size or a usable peak there (fixed costs, such as the text encoders', make small sizes grow
    more slowly than large ones: clamping to linear keeps the estimate on the safe side)."""
    if plan.smaller is None or peak_smaller is None or peak_smaller <= 0 or peak_small <= 0:
        return MIN_GROWTH
    k = math.log(peak_small / peak_smaller) / math.log(bucket_pixels(plan.small) / bucket_pixels(plan.smaller))
    return min(max(k, MIN_GROWTH), MAX_GROWTH)


def scale_peaks(plan: ProbePlan, peaks: dict[int, int], k: float) -> dict[int, int]:
    """The peaks measured at plan.small, scaled to plan.target by (target pixels / small pixels) ** k."""
    ratio = (bucket_pixels(plan.target) / bucket_pixels(plan.small)) ** k
    return {n: int(math.ceil(peak * ratio)) for n, peak in peaks.items()}


def probe_note(plan: ProbePlan, k: float, seconds: float, name) -> str:
    """What the start-up line adds: where the probe measured, how it scaled, how long it took."""
    if plan.small == plan.target:
        return f"measured in {seconds:.1f} s"
    return f"measured at {name(plan.small)} and scaled by pixels^{k:.2f}, in {seconds:.1f} s"
