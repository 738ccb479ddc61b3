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
    from scipy.ndimage import uniform_filter

    a, b = _grey(image), _grey(reference)
    if a.shape != b.shape:
        raise ValueError(f"images differ in size: {a.shape} vs {b.shape}")
    if min(a.shape) < WINDOW:
        raise ValueError(f"SSIM needs images of at least {WINDOW}x{WINDOW}, got {a.shape}")
    n = WINDOW * WINDOW
    cov = n / (n - 1)  # sample covariance

    def mean(x):
        return uniform_filter(x, size=WINDOW)

    ma, mb = mean(a), mean(b)
    va = cov * (mean(a * a) - ma * ma)
    vb = cov * (mean(b * b) - mb * mb)
    vab = cov * (mean(a * b) - ma * mb)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    s = ((2 * ma * mb + c1) * (2 * vab + c2)) / ((ma * ma + mb * mb + c1) * (va + vb + c2))
    pad = (WINDOW - 1) // 2
    return float(s[pad:-pad, pad:-pad].mean())
