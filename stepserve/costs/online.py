"""The step-time curve as the engine runs: a prior (a LatencyModel, or none) corrected online by the steps the
executor reports.

Per shape bucket, one denoising step of b requests is modelled as affine, T(b) = a + c * b: `a` is what a step
costs whatever its size (weights streamed, kernel launches, host work), `c` what one more request adds. The ratio
of the two is the cost regime: a small `c` (a small model, small images on a GPU) makes batching nearly free; a
small `a` (a DiT at 1024x1024) makes a batch of n cost about n steps of one. The fit is an exponentially weighted
least squares over the observed (b, seconds) pairs, so a curve that drifts (another process on the machine,
thermal limits, a different clock) is followed within a few dozen steps (`half_life_steps`). The prior's points
stay in the fit with a small fixed weight: they give the curve its shape while the observations do not vary in
b (e.g. every step at the same size), and they are outweighed as soon as the observations do. Where the steps
seen at one and at a larger size contradict the prior's gain between them, the prior's points are set aside and
the line is the observations' alone (its shape at each size, step_costs, still applies): its points at the
sizes never run would otherwise hold the slope against the probes.

A decision to batch or not (efficient_batch) is judged against the fit's uncertainty: the line's standard errors
at one request and at the batch size, from the residuals of the weighted fit. A slope read from a few probe steps
among many noisy steps of one size is uncertain, and a decision only changes when the steps say with confidence
that it is wrong (simulated: with step times spread 30% (lognormal) on a curve where batching gains 3%, the cap
went to a full batch in a quarter of the steps; now in none, over 20 seeds).

Pure arithmetic: no torch, no clock. The policy that reads it (scheduling/adaptive.py) is given the durations
the executor measured; the simulator's fake executor reports its charges the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .latency_model import Bucket, LatencyModel
from .line_fit import Fit, Sums, fit_line, gain
from .size_evidence import CONFIDENCE, SizeEvidence

DEFAULT_HALF_LIFE_STEPS = 30.0
PRIOR_WEIGHT = 0.05  # weight of each prior point against one observation
SIZE_DECAY = 0.5 ** (1 / 10)  # each batch size's own steps: a half-life of 10 of them


@dataclass
class OnlineStepCurve(SizeEvidence):
    """T(b) = a + c * b per bucket, fitted to a prior and to observed steps (see the module docstring)."""

    prior: LatencyModel | None = None
    max_batch_size: int = 8
    half_life_steps: float = DEFAULT_HALF_LIFE_STEPS
    _seen: dict[Bucket, Sums] = field(default_factory=dict)
    _prior: dict[Bucket, Sums] = field(default_factory=dict)
    observations: int = 0
    batching: dict[Bucket, bool] = field(default_factory=dict)  # the decision in force per bucket (decide())
    _prior_cache: dict[tuple[Bucket, int], float] = field(default_factory=dict)
    _shape: dict[Bucket, list[float]] = field(default_factory=dict)
    _sizes: dict[tuple[Bucket, int], Sums] = field(default_factory=dict)  # per batch size: its own steps' times
    _contradiction: dict[Bucket, bool] = field(default_factory=dict)  # _contradicted, until the next step observed
    # What the steps of each size say, kept until a step of that size is observed (a function of its sums alone):
    _size_mean_se: dict[tuple[Bucket, int], tuple[float, float] | None] = field(default_factory=dict)
    _size_verdict: dict[Bucket, dict[int, bool]] = field(default_factory=dict)  # n -> sizes 1 and n contradict
    _size_bounds: dict[Bucket, dict] = field(default_factory=dict)  # n -> size_gain_bounds at CONFIDENCE, likewise
    _said: dict[Bucket, list[float]] = field(default_factory=dict)  # the prior's gain at each n (_contradicts)

    def __post_init__(self) -> None:
        if not self.half_life_steps > 0:
            raise ValueError(f"half_life_steps must be > 0, got {self.half_life_steps}")
        self._decay = 0.5 ** (1.0 / self.half_life_steps)

    def observe(self, bucket: Bucket, batch_size: int, seconds: float) -> None:
        """One denoising step of `batch_size` requests of `bucket` took `seconds` (as the executor measured)."""
        if batch_size < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        bucket = tuple(bucket)
        sums = self._seen.get(bucket)
        if sums is None:
            sums = self._seen[bucket] = Sums()
        sums.decay_add(self._decay, batch_size, seconds)
        key = (bucket, batch_size)
        size = self._sizes.get(key)
        if size is None:
            size = self._sizes[key] = Sums()
        size.decay_add(SIZE_DECAY, batch_size, seconds)
        self._size_mean_se.pop(key, None)
        for kept in (self._size_verdict.get(bucket), self._size_bounds.get(bucket)):
            if kept:  # a step of one changes every size's verdict and bounds, a step of n those of n alone
                if batch_size == 1:
                    kept.clear()
                else:
                    kept.pop(batch_size, None)
        self._contradiction.pop(bucket, None)
        self.observations += 1

    def line(self, bucket: Bucket) -> tuple[float, float] | None:
        """(a, c): the fixed and per-request cost of one step of `bucket`, as the fit has them now; None while
        nothing tells them apart (no prior, and every step seen so far was of one size)."""
        fit = self.fit(bucket)
        return None if fit is None else fit.line()

    def fit(self, bucket: Bucket) -> "Fit | None":
        """The weighted least-squares line through the prior's points and the observed steps, with the standard
        error of its slope; None while nothing tells the sizes apart. Where the steps seen at one and at some
        larger size contradict the prior (the gain they show, within CONFIDENCE standard errors of each size's
        own steps, excludes the prior's), the line through the observed steps alone, when they tell the sizes
        apart (else through each size's own recent steps: a size not run for long fades from the observations
        sooner): the prior's points at the sizes never run would otherwise hold the line's slope whatever the
        probes show (a profile that said a batch of n costs n steps of one kept an engine one at a time where
        a batch of 8 gained 2.4x)."""
        bucket = tuple(bucket)
        prior, seen = self._prior_sums(bucket), self._seen.get(bucket)
        if prior is None or seen is None:  # one set of sums (or none): its own line
            part = seen if prior is None else prior
            return None if part is None else fit_line(part)
        fit = fit_line(prior.plus(seen))
        if fit is None or not self._contradicted(bucket):
            return fit
        return fit_line(seen) or fit_line(self._size_sums(bucket)) or fit

    def _size_sums(self, bucket: Bucket) -> Sums:
        """Every batch size's own decayed steps of `bucket`, in one set of sums."""
        total = Sums()
        for n in range(1, self.max_batch_size + 1):
            part = self._sizes.get((bucket, n))
            if part is not None:
                total.merge(part)
        return total

    def gain_unsettled(self, bucket: Bucket, n: int, min_gain: float, fit: "Fit | None") -> bool:
        """Whether the steps seen leave it open if a batch of n gains more than `min_gain`: the fit's bounds
        straddle it, and so do those of the steps seen at one and at n (or there are too few of those)."""
        threshold = 1.0 + min_gain
        if fit is not None:
            low, high = fit.gain_bounds(n, CONFIDENCE)
            if not low <= threshold < high:
                return False
        bounds = self.size_gain_bounds(bucket, n, CONFIDENCE)
        return bounds is None or bounds[0] <= threshold < bounds[1]

    def step_s(self, bucket: Bucket, batch_size: int) -> float | None:
        line = self.line(bucket)
        return None if line is None else line[0] + line[1] * batch_size

    def step_costs(self, bucket: Bucket, n: int, spread: float = 0.0,
                   fit: "Fit | None | str" = "fit") -> list[float] | None:
        """Seconds of a step of 1..n requests: the fitted line, times the prior's own departure from a line at
        each size (a batch size the hardware runs better or worse than the line says: the tiny Flux on this CPU
        costs 10% less per request at 3 than at 1, and 2.5% less at 8); None while the line is unknown.

        `spread` > 0: the line batching gains least on within that many standard errors (the step at 1 as low and
        the step at n as high as the fit allows), for decisions that must not follow noise. `fit`: the fit when
        the caller has it already."""
        if fit == "fit":
            fit = self.fit(bucket)
        if fit is None:
            return None
        if spread > 0 and n > 1:
            (t1, e1), (tn, en) = fit.at(1, spread), fit.at(n, spread)
            if not math.isfinite(e1 + en):  # too few points to say anything: batching gains nothing
                t1, e1, tn, en = 1.0, 0.0, float(n), 0.0
            low, high = max(t1 - e1, 0.0), max(tn + en, t1 - e1, 0.0)
            line = (low * n - high) / (n - 1), (high - low) / (n - 1)  # through (1, low) and (n, high)
        else:
            line = fit.line()
        shape = self._prior_shape(tuple(bucket))
        return [(line[0] + line[1] * b) * (shape[b - 1] if b <= len(shape) else 1.0) for b in range(1, n + 1)]

    def _prior_shape(self, bucket: Bucket) -> list[float]:
        """The prior's step time at each batch size over the line fitted to it alone ([] without a prior)."""
        if self.prior is None:
            return []
        if bucket not in self._shape:
            fit = fit_line(self._prior_sums(bucket))
            a, c = fit.line() if fit is not None else (0.0, 0.0)
            points = [self._prior_at(bucket, b) for b in range(1, self.max_batch_size + 1)]
            self._shape[bucket] = [t / (a + c * b) if a + c * b > 0 else 1.0 for b, t in enumerate(points, 1)]
        return self._shape[bucket]

    def efficient_batch(self, bucket: Bucket, available: int, tolerance: float, min_gain: float,
                        fit: "Fit | None | str" = "fit", batching: bool | None = None) -> int:
        """How many of `available` requests one step should run. Throughput (requests stepped per second) grows
        with the batch on an affine curve; `gain` is how much more the largest batch gets than a batch of one.
        Below `min_gain`, batching buys almost nothing and only slows every batch-mate down: 1 (the requests then
        finish one after another, each sooner). Otherwise the smallest batch within `tolerance` of the largest's
        throughput: near `available` when batching is cheap, smaller where the curve flattens.

        `batching`: the decision in force (whether the last cap batched), for hysteresis. The gain is then judged
        at the edge of its uncertainty (the step times at 1 and at `available`, each +- CONFIDENCE standard
        errors of the fit): a decision changes only when the steps say with confidence that it is wrong. A slope
        read from a few probe steps among noisy steps of one size (a shared CPU: steps vary by 20-30%) otherwise
        makes the cap flip to a full batch and back, and
        every flip runs the requests of a compute-bound model side by side, each slowed by all the others.
        While batching, the steps seen at one and at `available` themselves (size_gain_bounds) can also show that
        it does not pay: each size is judged by its own noise, where the fit takes one noise for all sizes.
        None: the point estimate decides. `fit`: the fit when the caller has it already (fit(bucket))."""
        if available <= 1:
            return max(available, 0)
        if fit == "fit":
            fit = self.fit(bucket)
        if fit is None:  # nothing known yet: batch them all (which shows what a batch costs)
            return available
        a, c = fit.line()
        point = gain(a, c, available) > 1.0 + min_gain  # what the fit itself says
        if batching is None:
            pays = point
        else:  # batching now: stop only when even the best gain the steps allow is too little; and vice versa
            low, high = fit.gain_bounds(available, CONFIDENCE)
            sizes = self.size_gain_bounds(bucket, available, CONFIDENCE) if batching else None
            if sizes is not None:  # batching: the steps at 1 and at `available` themselves can show it does not pay
                high = min(high, sizes[1])
            pays = (high if batching else low) > 1.0 + min_gain
        if not pays:
            return 1
        if not point:  # batching in force, and not yet shown wrong: all of them
            return available
        best = available / (a + c * available)
        for b in range(1, available + 1):
            if b / (a + c * b) >= (1.0 - tolerance) * best:
                return b
        return available

    def decide(self, bucket: Bucket, available: int, tolerance: float, min_gain: float,
               fit: "Fit | None | str" = "fit") -> int:
        """efficient_batch with the decision in force for `bucket`, which it updates (hysteresis). Before any
        decision, not batching: batching must first be shown to pay (the least gain the fit allows above the
        threshold), so a start-up profile whose small gain is within its own noise does not commit an engine that
        starts saturated to full batches that the steps then cannot overturn (every step a full batch; live, the
        tiny Flux on a slower CPU ran them at 0.7x the capacity of one at a time)."""
        cap = self.efficient_batch(bucket, available, tolerance, min_gain, fit=fit,
                                   batching=self.batching.get(tuple(bucket), False))
        if available > 1:
            self.batching[tuple(bucket)] = cap > 1
        return cap

    def _prior_at(self, bucket: Bucket, batch_size: int) -> float:
        key = (bucket, batch_size)
        t = self._prior_cache.get(key)
        if t is None:
            t = self._prior_cache[key] = self.prior.step_s(batch_size, bucket)
        return t

    def _prior_sums(self, bucket: Bucket) -> Sums | None:
        if self.prior is None:
            return None
        bucket = tuple(bucket)
        if bucket not in self._prior:
            sums = Sums()
            for b in range(1, self.max_batch_size + 1):
                sums.add(b, self._prior_at(bucket, b), PRIOR_WEIGHT)
            self._prior[bucket] = sums
        return self._prior[bucket]
