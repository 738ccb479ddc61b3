"""Images for the edit tests (image to image, inpainting): seeded, so a test's inputs are the same every run."""

from __future__ import annotations

import numpy as np
from PIL import Image


def pixels(image) -> np.ndarray:
    """An image as int16 RGB values, for differences that do not wrap."""
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def start_image(seed: int, size: int = 16, vertical: bool = False) -> Image.Image:
    """A gradient (left to right, or top to bottom) with noise."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size)
    base = (ramp[:, None, None] * np.ones((1, size, 3))) if vertical else (ramp[None, :, None] * np.ones((size, 1, 3)))
    return Image.fromarray(np.clip(base + rng.normal(0, 30, (size, size, 3)), 0, 255).astype(np.uint8))


def mask_image(seed: int, size: int = 16) -> Image.Image:
    """A grey-level mask (the processors binarise it at 0.5): a random square of half the side to repaint."""
    rng = np.random.default_rng(1000 + seed)
    m = np.full((size, size), 40, dtype=np.uint8)
    top, left = rng.integers(0, size // 2, 2)
    m[top : top + size // 2, left : left + size // 2] = 220
    return Image.fromarray(m, mode="L")


def assert_each_its_own(engine, requests) -> None:
    """Served together in one engine, every request gets the image it gets alone (uint8 within 1)."""
    alone = [engine.generate([p])[0] for p in requests]
    together = engine.generate(requests)
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
