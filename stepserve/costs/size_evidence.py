"""What each batch size's own steps say, for the online step curve (costs/online.py): their mean step time and its
standard error, the gain of a batch of n over one that the steps seen at those two sizes allow, and whether that
gain contradicts the prior's. Each read is kept until a step that changes it is observed (OnlineStepCurve.observe
drops it): a step of one changes every size's, a step of n those of n alone. Pure arithmetic."""

from __future__ import annotations

from .latency_model import Bucket
from .line_fit import gain_interval, mean_se

_MISSING = object()  # not kept yet
CONFIDENCE = 3.0  # standard errors of the fit a batching decision must clear to change (efficient_batch); at 2,
# a run of slow steps of one (a mean 3.5 standard errors high in 3,000 noisy steps) still flipped it


class SizeEvidence:
    """The per-size reads of OnlineStepCurve, which holds their state (_sizes, _size_mean_se, _size_verdict,
    _size_bounds, _contradiction, _said) and the prior (_prior_at, max_batch_size)."""

    def _contradicted(self, bucket: Bucket) -> bool:
        """Whether the steps seen at one and at some larger size n (each size's own mean and noise,
        size_gain_bounds) put the gain of a batch of n outside what the prior says it is. Kept until the next
        step of `bucket` is observed (the policy reads the fit several times a step)."""
        got = self._contradiction.get(bucket)
        if got is None:
            got = self._contradiction[bucket] = self._contradicts(bucket)
        return got

    def _contradicts(self, bucket: Bucket) -> bool:
        ones = self._mean_se(bucket, 1)  # read once for every n
        if ones is None:
            return False
        verdicts = self._size_verdict.get(bucket)
        if verdicts is None:
            verdicts = self._size_verdict[bucket] = {}
        elif True in verdicts.values():  # a kept verdict already says so (each is a function of its sizes' sums)
            return True
        for n in range(2, self.max_batch_size + 1):
            verdict = verdicts.get(n)
            if verdict is None:
                verdict = verdicts[n] = self._size_contradicts(bucket, n, ones)
            if verdict:
                return True
        return False

    def _size_contradicts(self, bucket: Bucket, n: int, ones: tuple[float, float]) -> bool:
        """Whether the steps seen at one (`ones`) and at n put the gain of a batch of n outside the prior's."""
        bounds = self._confident_bounds(bucket, n, ones)
        if bounds is None:
            return False
        said = self._said.get(bucket)
        if said is None:
            one = self._prior_at(bucket, 1)
            said = self._said[bucket] = [min(max(b * one / max(self._prior_at(bucket, b), 1e-12), 1.0), float(b))
                                         for b in range(1, self.max_batch_size + 1)]
        return not bounds[0] - 1e-9 <= said[n - 1] <= bounds[1] + 1e-9

    def _mean_se(self, bucket: Bucket, n: int) -> tuple[float, float] | None:
        """mean_se of the steps seen at size n, kept until the next of them is observed."""
        key = (bucket, n)
        got = self._size_mean_se.get(key, _MISSING)
        if got is _MISSING:
            got = self._size_mean_se[key] = mean_se(self._sizes.get(key))
        return got

    def size_gain_bounds(self, bucket: Bucket, n: int, spread: float,
                         ones: tuple[float, float] | None = None) -> tuple[float, float] | None:
        """(lowest, highest) gain of a batch of n over one from the steps seen at those two sizes alone (each
        size's mean and the standard error of its own steps, `spread` of them); None until each has a few. Its
        noise is each size's own, where the fit's is one for all sizes: step times that spread in proportion
        to the step (a shared CPU) leave the fit's bound wide however many steps of one size are seen. `ones`:
        the steps of one's (mean, standard error) when the caller has them already."""
        bucket = tuple(bucket)
        if spread == CONFIDENCE:  # the spread every decision reads: kept until a step of one or of n
            return self._confident_bounds(bucket, n, ones)
        return self._gain_bounds(bucket, n, spread, ones)

    def _confident_bounds(self, bucket: Bucket, n: int,
                          ones: tuple[float, float] | None = None) -> tuple[float, float] | None:
        """size_gain_bounds at CONFIDENCE (`bucket` a tuple), kept until a step of one or of n is observed."""
        kept = self._size_bounds.get(bucket)
        if kept is None:
            kept = self._size_bounds[bucket] = {}
        got = kept.get(n, _MISSING)
        if got is _MISSING:
            got = kept[n] = self._gain_bounds(bucket, n, CONFIDENCE, ones)
        return got

    def _gain_bounds(self, bucket: Bucket, n: int, spread: float,
                     ones: tuple[float, float] | None) -> tuple[float, float] | None:
        if ones is None:
            ones = self._mean_se(bucket, 1)
        many = self._mean_se(bucket, n)
        if ones is None or many is None:
            return None
        return gain_interval(ones[0], spread * ones[1], many[0], spread * many[1], n)
