"""Measure the embedded model: does a digit classifier read back the digit that was asked for?"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from ..util.digits import DIGIT_PROMPTS
from ..request.types import SCHEDULER_CLASSES


def eval_prompts() -> list[tuple[str, int]]:
    return [(str(d), d) for d in range(10)] + [(DIGIT_PROMPTS[d], d) for d in range(10)]


def digit_classifier():
    """An RBF SVM on the raw 8x8 digits (0..16 values); ~99% held-out accuracy."""
    from sklearn.datasets import load_digits
    from sklearn.svm import SVC

    digits = load_digits()
    return SVC(gamma=0.001, C=10.0).fit(digits.data, digits.target)


def image_to_8x8(img) -> np.ndarray:
    """PIL image -> 64 features on sklearn's 0..16 scale (grey, area-averaged down to 8x8)."""
    g = np.asarray(img.convert("L"), dtype=np.float64) / 255.0
    h, w = g.shape
    g = g[: h - h % 8, : w - w % 8].reshape(8, h // 8, 8, w // 8).mean(axis=(1, 3))
    return (g * 16.0).reshape(-1)


def load_pipeline(folder: str | Path, sampler: str = "ddim"):
    import diffusers
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(os.path.abspath(folder), local_files_only=True)
    pipe.scheduler = getattr(diffusers, SCHEDULER_CLASSES[sampler]).from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def measure_agreement(folder: str | Path, sampler: str, steps: int, guidance: float, seeds=(0, 1, 2),
                      clf=None, pipe=None) -> dict:
    """Generate every eval prompt for each seed; return agreement and the mean seed-to-seed pixel difference."""
    pipe = pipe or load_pipeline(folder, sampler)
    clf = clf or digit_classifier()
    prompts = eval_prompts()
    feats, images = [], {}
    for s in seeds:
        gens = [torch.Generator().manual_seed(s) for _ in prompts]
        out = pipe([p for p, _ in prompts], num_inference_steps=steps, guidance_scale=guidance, generator=gens)
        images[s] = [np.asarray(im.convert("L"), dtype=np.float64) for im in out.images]
        feats += [image_to_8x8(im) for im in out.images]
    pred = clf.predict(np.stack(feats))
    want = np.array([d for _ in seeds for _, d in prompts])
    diffs = [np.abs(images[a][i] - images[b][i]).mean() for i in range(len(prompts))
             for a in seeds for b in seeds if a < b]
    per_digit = {d: float((pred[want == d] == d).mean()) for d in range(10)}
    return {"agreement": float((pred == want).mean()), "per_digit": per_digit,
            "min_seed_diff": float(np.min(diffs)), "mean_seed_diff": float(np.mean(diffs))}
