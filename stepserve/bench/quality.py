"""Image quality against a reference image (a cached run against the uncached one): PSNR and SSIM.

SSIM is Wang, Bovik, Sheikh and Simoncelli (IEEE TIP 2004) on the grey image, over 7x7 uniform windows with the
sample covariance and K1 = 0.01, K2 = 0.03, L = 255 (scikit-image's defaults), averaged over the windows that
lie inside the image."""

from __future__ import annotations

import math

import numpy as np

WINDOW = 7


def _grey(image) -> np.ndarray:
    return np.asarray(image.convert("L"), dtype=np.float64)


def psnr(image, reference) -> float:
    """Peak signal-to-noise ratio in dB over RGB (inf for identical images)."""
    a = np.asarray(image.convert("RGB"), dtype=np.float64)
    b = np.asarray(reference.convert("RGB"), dtype=np.float64)
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0**2 / mse)


def ssim(image, reference) -> float:
    """Mean structural similarity of the grey images (1.0 for identical images)."""
    from numpy.lib.stride_tricks import sliding_window_view

    a, b = _grey(image), _grey(reference)
    if a.shape != b.shape:
        raise ValueError(f"images differ in size: {a.shape} vs {b.shape}")
    if min(a.shape) < WINDOW:
        raise ValueError(f"SSIM needs images of at least {WINDOW}x{WINDOW}, got {a.shape}")
    n = WINDOW * WINDOW
    cov = n / (n - 1)  # sample covariance

    def mean(x):  # the mean of every window that lies inside the image
        return sliding_window_view(x, (WINDOW, WINDOW)).mean(axis=(-2, -1))

    ma, mb = mean(a), mean(b)
    va = cov * (mean(a * a) - ma * ma)
    vb = cov * (mean(b * b) - mb * mb)
    vab = cov * (mean(a * b) - ma * mb)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    s = ((2 * ma * mb + c1) * (2 * vab + c2)) / ((ma * ma + mb * mb + c1) * (va + vb + c2))
    return float(s.mean())


# --- bench --quality --------------------------------------------------------------------------------------------
def _cached(spec) -> bool:
    return spec.cache not in (None, "off", "none", False)


def uncached_images(executor, max_batch_size: int):
    """specs -> their images generated on `executor` without step caching (continuous batching; a request's
    image does not depend on its batch-mates)."""

    def generate(specs: list) -> list:
        from dataclasses import replace

        from ..api import Engine

        engine = Engine(executor, strategy="continuous", max_batch_size=max_batch_size)
        return [r.image for r in engine.generate([replace(s, cache="off").to_params() for s in specs])]

    return generate


def add_quality(results, runs, uncached) -> None:
    """Set each contender summary's cached_images, psnr_db and ssim: its step-cached images (every repeat) against
    the same requests generated once without caching."""
    specs = {}
    for run in runs:
        for sample in run.images:
            if _cached(sample.spec) and sample.image is not None:
                specs.setdefault(sample.index, sample.spec)
    if not specs:
        return
    reference = dict(zip(specs, uncached(list(specs.values()))))
    for summary in results.summaries:
        pairs = [(s.image, reference[s.index]) for run in runs if run.metrics.contender == summary.contender
                 for s in run.images if s.index in reference and s.image is not None]
        if pairs:
            summary.cached_images = len(pairs)
            summary.psnr_db = float(np.mean([min(psnr(a, b), PSNR_CAP_DB) for a, b in pairs]))
            summary.ssim = float(np.mean([ssim(a, b) for a, b in pairs]))


PSNR_CAP_DB = 99.0  # an identical image counts as this in a mean


def quality_lines(summaries) -> list[str]:
    """The report's step-caching section: per contender the share of steps that reused cached work and, with
    bench --quality, PSNR / SSIM of the cached images (nothing when no request cached)."""
    rows = [s for s in summaries if s.cached_images or (s.cached_step_frac.median or 0) > 0]
    if not rows:
        return []
    lines = ["## Step caching (quality against the same requests without caching, with --quality)", "",
             "| contender | steps that reused cached work | cached images compared | PSNR (dB) | SSIM |",
             "|---|---|---|---|---|"]
    for s in rows:
        share = f"{s.cached_step_frac.median:.0%}" if s.cached_step_frac.median is not None else "-"
        quality = [f"{s.psnr_db:.1f}", f"{s.ssim:.3f}"] if s.cached_images else ["-", "-"]
        lines.append(f"| {s.contender} | {share} | {s.cached_images} | {quality[0]} | {quality[1]} |")
    return lines + ["", f"PSNR of an identical image counts as {PSNR_CAP_DB:g} dB in the mean.", ""]
