"""Tiny Flux.1 [dev] with --ulysses-degree 2 on the CPU (two gloo ranks): requests of mixed sizes, steps and guidance
sent together equal diffusers' FluxPipeline run alone (uint8 within 1); rows with a LoRA, step caching (fbcache,
magcache), a ControlNet and an image to image in the same batches each equal themselves served by one process; a
text the plan cannot split is refused at start-up in one line."""

import json

import numpy as np
import pytest
import torch
from control_reference import build_controlnets
from edit_images import start_image
from sequence_cases import assert_each_equals_one_process, one_process_with_lora, split_engine, with_strategy
from served_equal import assert_served_equal

from stepserve import Engine, SamplingParams
from stepserve.parallel.degrees import Degrees

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux

    root = tmp_path_factory.mktemp("flux_sequence")
    path = build_tiny_flux(root / "pipe", variant="dev")
    return path, build_controlnets(path, root / "controlnets")


@pytest.fixture(scope="module")
def split(flux):
    with split_engine(flux[0], controlnet_dir=str(flux[1])) as engine:
        yield engine


def mixed(n=4):
    """Two sizes (4 and 6 image tokens: both split over 2 ranks), three step counts, three guidance values."""
    return [SamplingParams(prompt=["a red fox", "seven", "zz top at dawn", "blue sky"][i % 4] + f" {i}",
                           seed=2000 + 31 * i, num_inference_steps=[2, 4, 3][i % 3],
                           guidance_scale=[3.5, 1.0, 6.0][i % 3], sampler="flow_euler",
                           height=[32, 48][i % 2], width=32) for i in range(n)]


def reference_image(path, p: SamplingParams) -> np.ndarray:
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


@pytest.fixture(scope="module")
def references(flux):
    return [reference_image(flux[0], p) for p in mixed()]


@pytest.mark.parametrize("strategy", ["continuous", pytest.param("slo", marks=pytest.mark.slow)])
def test_mixed_requests_equal_diffusers_pipeline(split, references, strategy):
    params = mixed()
    results = with_strategy(split, strategy).generate(params)
    assert_served_equal(results, params, references, strategy)


@pytest.fixture(scope="module")
def one_process(flux, split, tmp_path_factory):
    """The same model on one process, with the same add-ons (a LoRA loaded into it and into the split engine)."""
    return one_process_with_lora(flux[0], flux[1], split, tmp_path_factory.mktemp("flux_sequence_lora"), "x", 5)


def feature_rows():
    """A plain row, a LoRA row, two cached rows (fbcache decides on the first block's residual, now split; magcache
    by its schedule), a ControlNet row, an image to image row and one with both, of two sizes. The ControlNet row
    outlasts the cached ones: its last steps run the transformer's own forward, its first ones the caching
    forward."""
    base = dict(guidance_scale=3.5, sampler="flow_euler", width=32)
    return [
        SamplingParams(prompt="plain", seed=1, num_inference_steps=6, height=32, **base),
        SamplingParams(prompt="with a lora", seed=2, num_inference_steps=6, height=48,
                       loras=[{"name": "x", "scale": 0.8}], **base),
        SamplingParams(prompt="first block cache", seed=3, num_inference_steps=9, height=32,
                       cache={"policy": "fbcache", "threshold": 0.6}, **base),
        SamplingParams(prompt="magnitude cache", seed=4, num_inference_steps=9, height=48,
                       cache={"policy": "magcache", "threshold": 0.5}, **base),
        SamplingParams(prompt="a pose", seed=5, num_inference_steps=12, height=32,
                       controls=[{"name": "pose", "image": start_image(5, 32), "scale": 1.0}], **base),
        SamplingParams(prompt="an edit", seed=6, num_inference_steps=6, height=32, image=start_image(6, 32),
                       strength=0.7, **base),
        SamplingParams(prompt="an edit with a pose", seed=7, num_inference_steps=6, height=48,
                       image=start_image(7, 32, vertical=True), strength=0.8,
                       controls=[{"name": "depth", "image": start_image(8, 32), "scale": 0.9}], **base),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_feature_rows_each_equal_one_process(split, one_process, strategy):
    rows = feature_rows()
    assert_each_equals_one_process(with_strategy(split, strategy), one_process, rows)
    cached = [r.timing.cached_steps for r in one_process.generate(rows[2:4])]
    assert all(c > 0 for c in cached), cached  # the cached rows did skip steps (the same ones, checked above)


def test_a_text_the_plan_cannot_split_is_refused_at_start(flux, tmp_path):
    """Flux.1's plan splits the T5 tokens too: a max_sequence_length that the degree does not divide is one line at
    start-up, before any worker starts."""
    import shutil

    folder = tmp_path / "pipe"
    shutil.copytree(flux[0], folder)
    serving = json.loads((folder / "stepserve.json").read_text())
    (folder / "stepserve.json").write_text(json.dumps({**serving, "max_sequence_length": 77}))
    with pytest.raises(ValueError) as err:
        Engine.from_pretrained(str(folder), degrees=Degrees(ulysses=2), threads=1, memory_cap=False)
    message = str(err.value)
    assert "\n" not in message and "77 text tokens" in message and "a degree that divides 77" in message
