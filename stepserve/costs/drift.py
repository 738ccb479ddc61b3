"""A latency model corrected by the step times the engine observes: a start-up profile is a prior, not the truth.

A profile is measured once, on a machine whose speed drifts (another process on the cores, thermal limits, a
different GPU clock). The `slo` policy refuses requests at admission and gives up on them by its predictions, so a
profile taken in a slow minute refuses requests that would have made it, and one taken in a fast minute admits
requests that will not. DriftCorrected reads like the profile (step_s, encode_s, decode_s, reference_bucket,
metadata) with every prediction multiplied by the ratio of the step times the executor reported to what the
profile predicted for those same steps (same bucket, same batch size), exponentially weighted over the last
`half_life_steps` steps: one number per bucket (all buckets pooled for encodes, and for a bucket not yet seen).
The same correction offline (the profile scaled by a live run's own step times) brought the simulated percentiles
within 15% of the live ones in 16 of 20 against 13 of 20 (docs/BENCHMARKS.md, "Simulation: speed and fidelity").

On a device shared with other models (engine/device.py), a model's steps get only its share of the device while the
others have work: `share` (set before each step by whoever runs the engine) stretches every prediction by 1/share,
so the slo policy admits and keeps only what its share can finish. The steps it observes are its own device time,
so the drift itself is unaffected.

Pure arithmetic, no clock: the policy calls observe() with what the executor measured.
"""

from __future__ import annotations

import math

from .latency_model import Bucket, LatencyModel

DEFAULT_HALF_LIFE_STEPS = 200.0  # long enough that a few noisy steps do not move admission, short enough to follow


class DriftCorrected:
    def __init__(self, prior: LatencyModel, half_life_steps: float = DEFAULT_HALF_LIFE_STEPS) -> None:
        if not half_life_steps > 0:
            raise ValueError(f"half_life_steps must be > 0, got {half_life_steps}")
        self.prior = prior
        self._decay = 0.5 ** (1.0 / half_life_steps)
        self._seen: dict[Bucket, list[float]] = {}  # bucket: [observed seconds, predicted seconds], decayed
        self._all = [0.0, 0.0]
        self.share = 1.0  # of the device this model gets now (0 < share <= 1): predictions are stretched by 1/share

    @property
    def reference_bucket(self) -> Bucket:
        return self.prior.reference_bucket

    @property
    def metadata(self):
        return self.prior.metadata

    def observe(self, bucket: Bucket, batch_size: int, seconds: float) -> None:
        """A denoising step of `batch_size` requests of `bucket` took `seconds` (the executor's own measure)."""
        predicted = self.prior.step_s(batch_size, bucket)
        if batch_size < 1 or predicted <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        for sums in (self._seen.setdefault(tuple(bucket), [0.0, 0.0]), self._all):
            sums[0] = sums[0] * self._decay + seconds
            sums[1] = sums[1] * self._decay + predicted

    def factor(self, bucket: Bucket | None = None) -> float:
        """Observed over predicted step time for `bucket` (all buckets for None or an unseen one); 1 before any."""
        sums = self._seen.get(tuple(bucket), self._all) if bucket is not None else self._all
        return sums[0] / sums[1] if sums[1] > 0 else 1.0

    def step_s(self, batch_size: int, bucket: Bucket | None = None) -> float:
        return self.prior.step_s(batch_size, bucket) * self.factor(bucket or self.reference_bucket) / self.share

    def encode_s(self, n: int) -> float:
        return self.prior.encode_s(n) * self.factor() / self.share

    def decode_s(self, n: int, bucket: Bucket | None = None) -> float:
        return self.prior.decode_s(n, bucket) * self.factor(bucket or self.reference_bucket) / self.share

    def whole_device(self) -> "WholeDevice":
        """The same predictions at the whole device (share 1): what a request needs even alone on it."""
        return WholeDevice(self)


class WholeDevice:
    """A read-only view of a DriftCorrected at the whole device (its share ignored)."""

    def __init__(self, drift: DriftCorrected) -> None:
        self.drift = drift
        self.reference_bucket = drift.reference_bucket

    def step_s(self, batch_size: int, bucket: Bucket | None = None) -> float:
        d = self.drift
        return d.prior.step_s(batch_size, bucket) * d.factor(bucket or d.reference_bucket)

    def encode_s(self, n: int) -> float:
        return self.drift.prior.encode_s(n) * self.drift.factor()

    def decode_s(self, n: int, bucket: Bucket | None = None) -> float:
        d = self.drift
        return d.prior.decode_s(n, bucket) * d.factor(bucket or d.reference_bucket)
