"""The step-time curve as the engine runs: a prior (a LatencyModel, or none) corrected online by the steps the
executor reports.

Per shape bucket, one denoising step of b requests is modelled as affine, T(b) = a + c * b: `a` is what a step
costs whatever its size (weights streamed, kernel launches, host work), `c` what one more request adds. The ratio
of the two is the cost regime: a small `c` (a small model, small images on a GPU) makes batching nearly free; a
small `a` (a DiT at 1024x1024) makes a batch of n cost about n steps of one. The fit is an exponentially weighted
least squares over the observed (b, seconds) pairs, so a curve that drifts (another process on the machine,
thermal limits, a different clock) is followed within a few dozen steps (`half_life_steps`). The prior's points
stay in the fit with a small fixed weight: they give the curve its shape while the observations do not vary in
b (e.g. every step at the same size), and they are outweighed as soon as the observations do.

Pure arithmetic: no torch, no clock. The policy that reads it (scheduling/adaptive.py) is given the durations
the executor measured; the simulator's fake executor reports its charges the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .latency_model import Bucket, LatencyModel

DEFAULT_HALF_LIFE_STEPS = 30.0
PRIOR_WEIGHT = 0.05  # weight of each prior point against one observation


@dataclass
class _Sums:
    """Weighted sums for a least-squares line through (b, t)."""

    w: float = 0.0
    b: float = 0.0
    bb: float = 0.0
    t: float = 0.0
    bt: float = 0.0

    def add(self, b: float, t: float, weight: float = 1.0) -> None:
        self.w += weight
        self.b += weight * b
        self.bb += weight * b * b
        self.t += weight * t
        self.bt += weight * b * t

    def merge(self, other: "_Sums") -> None:
        self.w += other.w
        self.b += other.b
        self.bb += other.bb
        self.t += other.t
        self.bt += other.bt

    def scale(self, factor: float) -> None:
        self.w *= factor
        self.b *= factor
        self.bb *= factor
        self.t *= factor
        self.bt *= factor


@dataclass
class OnlineStepCurve:
    """T(b) = a + c * b per bucket, fitted to a prior and to observed steps (see the module docstring)."""

    prior: LatencyModel | None = None
    max_batch_size: int = 8
    half_life_steps: float = DEFAULT_HALF_LIFE_STEPS
    _seen: dict[Bucket, _Sums] = field(default_factory=dict)
    _prior: dict[Bucket, _Sums] = field(default_factory=dict)
    observations: int = 0

    def __post_init__(self) -> None:
        if not self.half_life_steps > 0:
            raise ValueError(f"half_life_steps must be > 0, got {self.half_life_steps}")
        self._decay = 0.5 ** (1.0 / self.half_life_steps)

    def observe(self, bucket: Bucket, batch_size: int, seconds: float) -> None:
        """One denoising step of `batch_size` requests of `bucket` took `seconds` (as the executor measured)."""
        if batch_size < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        sums = self._seen.setdefault(tuple(bucket), _Sums())
        sums.scale(self._decay)
        sums.add(batch_size, seconds)
        self.observations += 1

    def line(self, bucket: Bucket) -> tuple[float, float] | None:
        """(a, c): the fixed and per-request cost of one step of `bucket`, as the fit has them now; None while
        nothing tells them apart (no prior, and every step seen so far was of one size)."""
        total = _Sums()
        for part in (self._prior_sums(bucket), self._seen.get(tuple(bucket))):
            if part is not None:
                total.merge(part)
        if total.w <= 0:
            return None
        mean_b, mean_t = total.b / total.w, total.t / total.w
        var_b = total.bb / total.w - mean_b * mean_b
        if var_b <= 1e-9 * max(mean_b * mean_b, 1.0):  # every point at one size: no slope to see
            return None
        c = (total.bt / total.w - mean_b * mean_t) / var_b
        a = mean_t - c * mean_b
        if c < 0:  # a step never gets cheaper with more requests: a flat curve through the mean
            return max(mean_t, 0.0), 0.0
        if a < 0:  # never less than nothing for an empty step: a line through the origin
            return 0.0, max(total.bt / total.bb, 0.0)
        return a, c

    def step_s(self, bucket: Bucket, batch_size: int) -> float | None:
        line = self.line(bucket)
        return None if line is None else line[0] + line[1] * batch_size

    def efficient_batch(self, bucket: Bucket, available: int, tolerance: float, min_gain: float,
                        line: tuple[float, float] | None | str = "fit") -> int:
        """How many of `available` requests one step should run. Throughput (requests stepped per second) grows
        with the batch on an affine curve; `gain` is how much more the largest batch gets than a batch of one.
        Below `min_gain`, batching buys almost nothing and only slows every batch-mate down: 1 (the requests then
        finish one after another, each sooner). Otherwise the smallest batch within `tolerance` of the largest's
        throughput: near `available` when batching is cheap, smaller where the curve flattens. `line`: the fit
        when the caller has it already (line(bucket)), so it is not made twice."""
        if available <= 1:
            return max(available, 0)
        if line == "fit":
            line = self.line(bucket)
        if line is None:  # nothing known yet: batch them all (which shows what a batch costs)
            return available
        a, c = line
        if a <= 0:  # proportional: no batching gain at all
            return 1
        best = available / (a + c * available)
        if best <= (1.0 + min_gain) / (a + c):
            return 1
        for b in range(1, available + 1):
            if b / (a + c * b) >= (1.0 - tolerance) * best:
                return b
        return available

    def _prior_sums(self, bucket: Bucket) -> _Sums | None:
        if self.prior is None:
            return None
        bucket = tuple(bucket)
        if bucket not in self._prior:
            sums = _Sums()
            for b in range(1, self.max_batch_size + 1):
                sums.add(b, self.prior.step_s(b, bucket), PRIOR_WEIGHT)
            self._prior[bucket] = sums
        return self._prior[bucket]
