"""PSNR and SSIM as the bench reports them for cached runs: checked against a direct per-window computation of
Wang et al.'s formula and against known values."""

import math

import numpy as np
from PIL import Image

from stepserve.bench.quality import WINDOW, psnr, ssim


def image(arr) -> Image.Image:
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).convert("RGB")


def ssim_direct(a: np.ndarray, b: np.ndarray) -> float:
    """Every 7x7 window inside the image, one at a time: means, sample variances and covariance."""
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    values = []
    for i in range(a.shape[0] - WINDOW + 1):
        for j in range(a.shape[1] - WINDOW + 1):
            x, y = a[i:i + WINDOW, j:j + WINDOW].ravel(), b[i:i + WINDOW, j:j + WINDOW].ravel()
            mx, my = x.mean(), y.mean()
            vx, vy = x.var(ddof=1), y.var(ddof=1)
            cxy = ((x - mx) * (y - my)).sum() / (x.size - 1)
            values.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    return float(np.mean(values))


def test_ssim_equals_the_formula_window_by_window():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (24, 20)).astype(np.float64)
    b = np.clip(a + rng.normal(0, 25, a.shape), 0, 255).round()
    got = ssim(image(a), image(b))
    want = ssim_direct(np.asarray(image(a).convert("L"), np.float64), np.asarray(image(b).convert("L"), np.float64))
    assert abs(got - want) < 1e-9
    assert 0.0 < got < 0.99  # noisy, not identical


def test_identical_images():
    a = image(np.random.default_rng(1).integers(0, 256, (16, 16)))
    assert ssim(a, a) == 1.0 and psnr(a, a) == math.inf


def test_psnr_of_a_uniform_error():
    a = np.full((8, 8), 100.0)
    assert abs(psnr(image(a + 10), image(a)) - 10 * math.log10(255**2 / 100)) < 1e-9
