"""Acceptance tests for the embedded default model (stepserve/models/embedded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stepserve.util.digits import DIGIT_PROMPTS

EMBEDDED = Path(__file__).resolve().parents[1] / "stepserve" / "models" / "embedded"
SEEDS = (0, 1, 2)
MIN_SEED_DIFF = 4.0  # mean |a - b| over 0..255 grey pixels between two seeds of the same prompt


def _to_8x8(img) -> np.ndarray:
    """PIL image -> 64 features on scikit-learn's 0..16 digit scale (grey, area-averaged to 8x8)."""
    g = np.asarray(img.convert("L"), dtype=np.float64) / 255.0
    h, w = g.shape
    return (g.reshape(8, h // 8, 8, w // 8).mean(axis=(1, 3)) * 16.0).reshape(-1)


@pytest.fixture(scope="module")
def classifier():
    from sklearn.datasets import load_digits  # in the test extra: a missing sklearn is an error, never a skip
    from sklearn.svm import SVC

    digits = load_digits()
    return SVC(gamma=0.001, C=10.0).fit(digits.data, digits.target)


def test_folder_is_a_stable_diffusion_pipeline():
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    size = sum(f.stat().st_size for f in EMBEDDED.rglob("*") if f.is_file())
    assert size <= 25 * 1024 * 1024, f"embedded model is {size / 2**20:.1f} MiB"
    assert list(EMBEDDED.rglob("*.safetensors")), "weights must be safetensors"

    pipe = StableDiffusionPipeline.from_pretrained(str(EMBEDDED))
    assert isinstance(pipe.unet, UNet2DConditionModel) and isinstance(pipe.vae, AutoencoderKL)
    assert isinstance(pipe.text_encoder, CLIPTextModel) and isinstance(pipe.tokenizer, CLIPTokenizer)
    assert pipe.safety_checker is None and pipe.feature_extractor is None
    assert pipe.scheduler.config.num_train_timesteps == 1000

    tok = CLIPTokenizer.from_pretrained(EMBEDDED / "tokenizer")
    assert tok.model_max_length == pipe.text_encoder.config.max_position_embeddings
    ids = [tuple(tok(p).input_ids) for p in ("7", "seven", "a handwritten seven", "")]
    assert len(set(ids)) == len(ids)
    assert all(len(i) <= tok.model_max_length for i in ids)

    cfg = json.loads((EMBEDDED / "stepserve.json").read_text())
    assert cfg["default_sampler"] in ("ddim", "euler", "euler_a", "dpmpp_2m")
    assert isinstance(cfg["default_steps"], int) and 1 <= cfg["default_steps"] <= 100
    assert 1.0 <= float(cfg["default_guidance_scale"]) <= 20.0
    vae_factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    assert cfg["height"] == cfg["width"] == pipe.unet.config.sample_size * vae_factor
    assert cfg["min_size"] == cfg["max_size"] == cfg["height"]  # trained at one size: served at that size only
    assert isinstance(cfg.get("train"), dict) and "seed" in cfg["train"]

    pipe.set_progress_bar_config(disable=True)
    import torch

    out = pipe("3", num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert out.size == (cfg["width"], cfg["height"])


def test_engine_generates_the_requested_digits(classifier):
    from stepserve import Engine, SamplingParams

    prompts = [(str(d), d) for d in range(10)] + [(DIGIT_PROMPTS[d], d) for d in range(10)]
    engine = Engine.from_pretrained("embedded", strategy="continuous", max_batch_size=8)
    params = [SamplingParams(prompt=p, seed=s) for s in SEEDS for p, _ in prompts]
    results = engine.generate(params)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]

    images = [r.image for r in results]
    cfg = json.loads((EMBEDDED / "stepserve.json").read_text())
    assert images[0].size == (cfg["width"], cfg["height"])
    pred = classifier.predict(np.stack([_to_8x8(im) for im in images]))
    want = np.array([d for _ in SEEDS for _, d in prompts])
    agreement = float((pred == want).mean())
    wrong = [(params[i].prompt, params[i].seed, int(pred[i])) for i in np.flatnonzero(pred != want)]
    assert agreement >= 0.9, f"classifier agreement {agreement:.2f}; wrong: {wrong}"

    grey = np.stack([np.asarray(im.convert("L"), dtype=np.float64) for im in images])
    grey = grey.reshape(len(SEEDS), len(prompts), *grey.shape[1:])
    for j, (p, _) in enumerate(prompts):
        for a in range(len(SEEDS)):
            for b in range(a + 1, len(SEEDS)):
                diff = np.abs(grey[a, j] - grey[b, j]).mean()
                assert diff > MIN_SEED_DIFF, f"seeds {SEEDS[a]} and {SEEDS[b]} look alike for {p!r}: {diff:.2f}"


@pytest.mark.parametrize("sampler, steps", [("ddim", 15), ("euler", 15), ("euler_a", 15), ("dpmpp_2m", 8),
                                            ("dpmpp_2m", 30)])
def test_other_samplers_and_step_counts_give_the_requested_digits(classifier, sampler, steps):
    from stepserve import Engine, SamplingParams

    prompts = [(str(d), d) for d in range(10)] + [(DIGIT_PROMPTS[d], d) for d in range(10)]
    engine = Engine.from_pretrained("embedded", strategy="continuous", max_batch_size=8)
    params = [SamplingParams(prompt=p, seed=s, sampler=sampler, num_inference_steps=steps)
              for s in SEEDS for p, _ in prompts]
    results = engine.generate(params)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    pred = classifier.predict(np.stack([_to_8x8(r.image) for r in results]))
    want = np.array([d for _ in SEEDS for _, d in prompts])
    agreement = float((pred == want).mean())
    wrong = [(params[i].prompt, params[i].seed, int(pred[i])) for i in np.flatnonzero(pred != want)]
    assert agreement >= 0.9, f"{sampler} at {steps} steps: classifier agreement {agreement:.2f}; wrong: {wrong}"


def test_only_the_trained_size_is_served():
    from stepserve import Engine, SamplingParams, ValidationError

    engine = Engine.from_pretrained("embedded")
    info = engine.model_info
    assert (info.min_size, info.max_size, info.default_height, info.default_width) == (32, 32, 32, 32)
    for field, size in (("height", 48), ("width", 16), ("height", 64), ("width", 24)):
        with pytest.raises(ValidationError) as caught:
            engine.generate([SamplingParams(prompt="7", seed=0, num_inference_steps=1, **{field: size})])
        asked = f"{size}x32" if field == "width" else f"32x{size}"
        assert caught.value.field == field
        assert str(caught.value) == (f"{field}: {asked} (width x height) is not supported; allowed: 32x32 only "
                                     f"(embedded was trained at that size)")
    ok = engine.generate([SamplingParams(prompt="7", seed=0, num_inference_steps=1, height=32, width=32)])
    assert ok[0].ok and ok[0].image.size == (32, 32)
