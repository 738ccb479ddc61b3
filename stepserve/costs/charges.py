"""What a measured LatencyModel charges for a batch: the cost function the fake executor charges in simulation
(FakeExecutor.charging), so the real EngineCore and policies run on a simulated clock at the speed of a profiled
model and device: `stepserve profile` measures once, the simulator replays any trace on those numbers.

What each stage charges, for a batch of n requests of which g have guidance rows (guidance_scale > 1 on a model
with classifier-free guidance; none on one that embeds the scale, `metadata["guidance"] == "embedded"`, as
Flux.1 dev and Flux.2 dev do):
- denoise: the step curve of the batch's bucket. With curves measured both with and without guidance rows
  (`metadata["by_guidance_rows"]`, stepserve.costs.guidance) a batch costs U(n) + (G(n) - U(n)) * g / n, U
  and G the curves without and with guidance: exact for batches of one kind, and linear in the number of
  guidance rows in between. With one curve measured at R rows per request, the batch costs the curve at
  (its rows) / R requests (a request with guidance is 2 rows). A curve whose rows are not recorded costs n.
- prepare: the encode curve, by the same rule (guidance encodes a negative prompt too).
- decode: the decode curve of each bucket in the batch, at that bucket's count, summed.
Buckets that were not measured cost as LatencyModel says (the nearest measured bucket scaled by pixels).

Noise: with `noise` > 0 each charge is multiplied by 1 + noise * (x - 1), x drawn uniformly between the fastest
and slowest recorded repeat of the nearest measured point, relative to the curve there (the model's
`metadata["spread"]`). With noise 1 the charges span the measured spread; the draws come from a
random.Random(seed), so a seed gives the same run every time.

Per call the work is a few dictionary look-ups (costs are cached per bucket, batch size and guided count), so
a simulation of 100k requests is bounded by the engine, not by these charges.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Mapping

from ..request.buckets import bucket_pixels
from ..request.types import Request
from .guidance import GuidanceCurves, Spread, by_guidance_rows, spread_by_bucket
from .latency_model import Bucket, Curve, LatencyModel


class LatencyCharges:
    """A cost function (encode_s, step_s, decode_s of a batch of requests) read from a LatencyModel."""

    def __init__(self, latency: LatencyModel, noise: float = 0.0, seed: int = 0) -> None:
        if not isinstance(noise, (int, float)) or isinstance(noise, bool) or not math.isfinite(noise) or noise < 0:
            raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
        self.latency = latency
        self.noise = float(noise)
        self.seed = seed
        self._rng = random.Random(seed)
        curves = by_guidance_rows(latency)
        self._unguided = curves.get(1)
        self._guided = curves.get(2)
        self._only = None if (self._unguided and self._guided) else next(iter(curves.values()))
        self._embedded = latency.metadata.get("guidance") == "embedded"  # the scale adds no row
        spread = latency.metadata.get("spread") if isinstance(latency.metadata.get("spread"), dict) else {}
        self._decode_spread = spread_by_bucket(spread.get("decode", []), "metadata.spread.decode")
        if self.noise > 0 and not self._has_spread():
            raise ValueError("noise > 0 draws from the spread of the measurements (metadata 'spread', as "
                             "`stepserve profile` writes it); this latency model records none")
        self._cost: dict[tuple[str, Bucket | None, int, int], tuple[float, float, float]] = {}

    def _has_spread(self) -> bool:
        every = [c for c in (self._unguided, self._guided, self._only) if c is not None]
        return bool(self._decode_spread) or any(c.step_spread or c.encode_spread for c in every)

    # --- the cost function the fake executor charges -----------------------------------------------------------
    def encode_s(self, requests: list[Request]) -> float:
        if not requests:
            return 0.0
        return self._charge("encode", None, len(requests), 0 if self._embedded else _guided(requests))

    def step_s(self, requests: list[Request]) -> float:
        if not requests:
            return 0.0
        return self._charge("step", requests[0].bucket, len(requests), 0 if self._embedded else _guided(requests))

    def decode_s(self, requests: list[Request]) -> float:
        counts: dict[Bucket, int] = {}
        for r in requests:
            counts[r.bucket] = counts.get(r.bucket, 0) + 1
        return sum(self._charge("decode", b, n, 0) for b, n in counts.items())

    # --- costs ---------------------------------------------------------------------------------------------------
    def seconds(self, stage: str, n: int, guided: int = 0, bucket: Bucket | None = None) -> float:
        """The noiseless charge of `stage` ('encode', 'step' or 'decode') for n requests, `guided` of them with
        guidance, of `bucket` (default: the reference bucket; ignored by 'encode')."""
        if stage not in ("encode", "step", "decode"):
            raise ValueError(f"stage must be 'encode', 'step' or 'decode', got {stage!r}")
        return self._entry(stage, bucket or self.latency.reference_bucket, n, guided)[0]

    def _charge(self, stage: str, bucket: Bucket | None, n: int, guided: int) -> float:
        key = (stage, None if stage == "encode" else bucket, n, guided)
        entry = self._cost.get(key)
        if entry is None:
            entry = self._cost[key] = self._entry(stage, bucket, n, guided)
        seconds, lo, hi = entry
        if self.noise == 0.0 or lo == hi:
            return seconds
        x = lo + (hi - lo) * self._rng.random()
        return max(seconds * (1.0 + self.noise * (x - 1.0)), 0.0)

    def _entry(self, stage: str, bucket: Bucket | None, n: int, guided: int) -> tuple[float, float, float]:
        """(seconds, low ratio, high ratio) of one charge: the cost and the measured spread around it."""
        if stage == "decode":
            seconds = self.latency.decode_s(n, bucket)
            curves = self.latency.decode
            spread = self._decode_spread
        else:
            parts = self._parts(n, guided)
            seconds = sum(w * _stage_s(c, stage, bucket, count) for c, w, count in parts)
            main = max(parts, key=lambda p: p[1])[0]  # the spread of the larger share
            curves = main.step if stage == "step" else {None: main.encode}
            spread = main.step_spread if stage == "step" else {None: main.encode_spread}
            bucket = bucket if stage == "step" else None
        lo, hi = _ratios(curves, spread, bucket, n)
        return seconds, lo, hi

    def _parts(self, n: int, guided: int) -> list[tuple[GuidanceCurves, float, float]]:
        """(curves, weight, count at which to read them) whose weighted sum is the charge; see the docstring."""
        if self._only is None:
            share = guided / n
            return [(self._unguided, 1.0 - share, n), (self._guided, share, n)]
        rows = self._only.rows
        count = n if rows is None else (n + guided) / rows
        return [(self._only, 1.0, count)]


def _guided(requests: list[Request]) -> int:
    """How many of the requests run guidance rows (a plain loop: this runs once per simulated step)."""
    guided = 0
    for r in requests:
        if r.params.guidance_scale > 1:
            guided += 1
    return guided


def _stage_s(curves: GuidanceCurves, stage: str, bucket: Bucket | None, count: float) -> float:
    if stage == "encode":
        return curves.encode(count)
    return _bucket_s(curves.step, bucket, count)


def _bucket_s(curves: Mapping[Bucket, Curve], bucket: Bucket, count: float) -> float:
    """As LatencyModel does: the bucket's curve, or the nearest measured bucket in pixels scaled by pixels."""
    curve = curves.get(bucket)
    if curve is not None:
        return curve(count)
    near = _nearest(curves, bucket)
    return curves[near](count) * bucket_pixels(bucket) / bucket_pixels(near)


def _nearest(curves: Mapping[Bucket, object], bucket: Bucket) -> Bucket:
    pixels = bucket_pixels(bucket)
    return min(curves, key=lambda b: (abs(bucket_pixels(b) - pixels), -bucket_pixels(b)))


def _ratios(curves: Mapping, spread: Mapping, bucket: Bucket | None, n: int) -> tuple[float, float]:
    """The fastest and slowest recorded repeat at the measured batch size nearest n, relative to the curve
    there; (1, 1) where nothing was recorded."""
    if bucket is not None and bucket not in spread and spread:
        bucket = _nearest(spread, bucket)
    points: Spread = spread.get(bucket, ())
    curve = curves[_nearest(curves, bucket)] if bucket is not None and bucket not in curves else curves.get(bucket)
    if not points or curve is None:
        return 1.0, 1.0
    counts = [p[0] for p in points]
    i = bisect.bisect_left(counts, n)
    if i == len(points) or (i > 0 and n - counts[i - 1] < counts[i] - n):
        i -= 1
    count, lo, hi = points[i]
    at = curve(count)
    if at <= 0:
        return 1.0, 1.0
    return lo / at, hi / at
