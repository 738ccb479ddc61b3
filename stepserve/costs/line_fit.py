"""The weighted least-squares line of the online step curve (costs/online.py), with the uncertainty its decisions
read: the fit of T(b) = a + c * b through exponentially weighted points, the standard errors of its slope and
level, and each batch size's own mean step time and standard error. Pure arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple


def gain(a: float, c: float, n: int) -> float:
    """Throughput of a batch of n over a batch of one on T(b) = a + c * b."""
    if a <= 0:
        return 1.0
    return n * (a + c) / (a + c * n)


def gain_interval(t1: float, e1: float, tn: float, en: float, n: int) -> tuple[float, float]:
    """(lowest, highest) throughput gain of a batch of n over one, the step at 1 taking t1 +- e1 seconds and the
    step at n tn +- en, each kept within [1, n]."""
    low = n * max(t1 - e1, 0.0) / max(tn + en, 1e-12)
    high = n * (t1 + e1) / max(tn - en, t1 + e1, 1e-12)
    return min(max(low, 1.0), n), min(max(high, 1.0), n)


class Fit(NamedTuple):
    """The fitted line as its centroid and slope, with the slope's standard error (immutable; a named tuple, the
    cheapest to build: one is made per engine step)."""

    mean_b: float  # the weighted mean batch size of the points
    mean_t: float  # and of their step times
    slope: float  # c, unclamped
    slope_se: float  # its standard error (inf while too few points say anything)
    level_se: float  # the standard error of the line at its centroid
    origin_slope: float  # the slope of the line through the origin (when the fit's intercept comes out < 0)

    def at(self, b: int, spread: float) -> tuple[float, float]:
        """(the fitted step time at batch size b, `spread` standard errors of it)."""
        return (self.mean_t + self.slope * (b - self.mean_b),
                spread * math.hypot(self.level_se, (b - self.mean_b) * self.slope_se))

    def gain_bounds(self, n: int, spread: float) -> tuple[float, float]:
        """(lowest, highest) throughput gain of a batch of n over a batch of one that the fit allows within
        `spread` standard errors of the step times at 1 and at n."""
        (t1, e1), (tn, en) = self.at(1, spread), self.at(n, spread)
        if not math.isfinite(e1 + en):
            return 1.0, float(n)
        return gain_interval(t1, e1, tn, en, n)

    def line(self) -> tuple[float, float]:
        """(a, c) through the centroid, kept physical: a step never gets cheaper with more requests (c < 0: flat
        through the mean), nor costs less than nothing empty (a < 0: through the origin)."""
        if self.slope < 0:
            return max(self.mean_t, 0.0), 0.0
        a = self.mean_t - self.slope * self.mean_b
        if a < 0:
            return 0.0, max(self.origin_slope, 0.0)
        return a, self.slope


@dataclass(slots=True)
class Sums:
    """Weighted sums for a least-squares line through (b, t), with what its uncertainty needs (t*t, and the sums of
    the squared weights)."""

    w: float = 0.0
    b: float = 0.0
    bb: float = 0.0
    t: float = 0.0
    bt: float = 0.0
    tt: float = 0.0
    ww: float = 0.0
    wwb: float = 0.0
    wwbb: float = 0.0

    def add(self, b: float, t: float, weight: float = 1.0) -> None:
        self.w += weight
        self.b += weight * b
        self.bb += weight * b * b
        self.t += weight * t
        self.bt += weight * b * t
        self.tt += weight * t * t
        self.ww += weight * weight
        self.wwb += weight * weight * b
        self.wwbb += weight * weight * b * b

    def plus(self, other: "Sums") -> "Sums":
        """New sums of both sets of points (each field this one's plus the other's: merging both into empty sums)."""
        return Sums(self.w + other.w, self.b + other.b, self.bb + other.bb, self.t + other.t, self.bt + other.bt,
                    self.tt + other.tt, self.ww + other.ww, self.wwb + other.wwb, self.wwbb + other.wwbb)

    def decay_add(self, factor: float, b: float, t: float) -> None:
        """scale(factor), then add(b, t) at weight 1: the same arithmetic in one call (an observed step)."""
        squared = factor * factor
        self.w = self.w * factor + 1.0
        self.b = self.b * factor + b
        self.bb = self.bb * factor + b * b
        self.t = self.t * factor + t
        self.bt = self.bt * factor + b * t
        self.tt = self.tt * factor + t * t
        self.ww = self.ww * squared + 1.0
        self.wwb = self.wwb * squared + b
        self.wwbb = self.wwbb * squared + b * b

    def merge(self, other: "Sums") -> None:
        self.w += other.w
        self.b += other.b
        self.bb += other.bb
        self.t += other.t
        self.bt += other.bt
        self.tt += other.tt
        self.ww += other.ww
        self.wwb += other.wwb
        self.wwbb += other.wwbb

    def scale(self, factor: float) -> None:
        self.w *= factor
        self.b *= factor
        self.bb *= factor
        self.t *= factor
        self.bt *= factor
        self.tt *= factor
        squared = factor * factor  # the squared weights decay with the square of the factor
        self.ww *= squared
        self.wwb *= squared
        self.wwbb *= squared


def mean_se(sums: "Sums | None") -> tuple[float, float] | None:
    """(mean step time, its standard error) of one batch size's steps; None with fewer than 3 (effective)."""
    if sums is None or sums.w <= 0 or sums.ww <= 0:
        return None
    n_eff = sums.w * sums.w / sums.ww
    if n_eff < 3:
        return None
    mean = sums.t / sums.w
    var = max(sums.tt / sums.w - mean * mean, 0.0) * n_eff / (n_eff - 1)
    return mean, math.sqrt(var / n_eff)


def fit_line(total: Sums) -> Fit | None:
    """The line through the points summed in `total` (OnlineStepCurve.fit)."""
    if total.w <= 0:
        return None
    mean_b, mean_t = total.b / total.w, total.t / total.w
    var_b = total.bb / total.w - mean_b * mean_b
    if var_b <= 1e-9 * max(mean_b * mean_b, 1.0):  # every point at one size: no slope to see
        return None
    c = (total.bt / total.w - mean_b * mean_t) / var_b
    a = mean_t - c * mean_b
    # The slope's uncertainty (weighted least squares with the weights as reliabilities): the residuals' spread
    # over the effective number of points, and how far from the centroid the weight lies. A size seen once
    # (a probe) among many steps of another leaves the slope uncertain, however the fit comes out.
    rss = (total.tt - 2 * a * total.t - 2 * c * total.bt + a * a * total.w + 2 * a * c * total.b
           + c * c * total.bb)
    n_eff = total.w * total.w / total.ww if total.ww > 0 else 0.0
    spread_b = total.wwbb - 2 * mean_b * total.wwb + mean_b * mean_b * total.ww  # sum of w^2 (b - mean)^2
    if n_eff > 2:
        sigma2 = max(rss, 0.0) / total.w * n_eff / (n_eff - 2)
        slope_se = math.sqrt(sigma2 * max(spread_b, 0.0)) / (total.w * var_b)
        level_se = math.sqrt(sigma2 / n_eff)
    else:
        slope_se = level_se = math.inf
    return Fit(mean_b, mean_t, c, slope_se, level_se, total.bt / total.bb)
