"""Tiny Qwen-Image with --ulysses-degree 2 on the CPU (two gloo ranks): its prompts have their own lengths, which
diffusers' plan splits with the image tokens, so a step's text is padded (with the mask) to a multiple of the
degree. Requests of mixed sizes, steps, guidance and prompt lengths sent together equal diffusers'
QwenImagePipeline run alone (uint8 within 1); rows with a LoRA, step caching and a ControlNet in the same batches
each equal themselves served by one process."""

import numpy as np
import pytest
import torch
from control_reference import build_controlnets
from edit_images import start_image
from sequence_cases import assert_each_equals_one_process, one_process_with_lora, split_engine, with_strategy
from served_equal import assert_served_equal

from stepserve import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batching_pays")]  # two ranks start: seconds


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from stepserve.tiny.qwenimage import build_tiny_qwenimage

    root = tmp_path_factory.mktemp("qwen_sequence")
    path = build_tiny_qwenimage(root / "pipe")
    return path, build_controlnets(path, root / "controlnets")


@pytest.fixture(scope="module")
def split(qwen):
    with split_engine(qwen[0], controlnet_dir=str(qwen[1])) as engine:
        yield engine


def mixed(n=5):
    """Prompts of odd and even lengths, with and without a negative prompt (true CFG: two rows), two sizes (16 and
    24 image tokens), different step counts and guidance."""
    prompts = ["a red fox", "seven", "zz top at dawn over a long quiet lake", "blue sky", "a lighthouse"]
    negatives = ["", "blurry", " ", "", "low quality, washed out"]
    return [SamplingParams(prompt=prompts[i % 5] + f" {i}", negative_prompt=negatives[i % 5], seed=300 + 17 * i,
                           num_inference_steps=[2, 4, 3][i % 3], guidance_scale=[4.0, 1.0, 6.5][i % 3],
                           height=[32, 48][i % 2], width=32) for i in range(n)]


def reference_image(path, p: SamplingParams) -> np.ndarray:
    """QwenImagePipeline alone: guidance_scale is its true_cfg_scale, the negative prompt passed only when set."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(p.prompt, negative_prompt=p.negative_prompt or None, true_cfg_scale=p.guidance_scale,
                 height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


@pytest.fixture(scope="module")
def references(qwen):
    return [reference_image(qwen[0], p) for p in mixed()]


@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_mixed_requests_equal_diffusers_pipeline(split, references, strategy):
    params = mixed()
    results = with_strategy(split, strategy).generate(params)
    assert_served_equal(results, params, references, strategy)


@pytest.fixture(scope="module")
def one_process(qwen, split, tmp_path_factory):
    """The same model on one process, with the same add-ons (a LoRA loaded into it and into the split engine)."""
    return one_process_with_lora(qwen[0], qwen[1], split, tmp_path_factory.mktemp("qwen_sequence_lora"), "p", 1)


def feature_rows():
    """A plain row, a LoRA row, a cached row (fbcache: decided on the first block's residual, now split) and a
    ControlNet row, of two sizes and prompt lengths, guided and not. The ControlNet row outlasts the cached one:
    its last steps run the transformer's own forward, its first ones the caching forward."""
    return [
        SamplingParams(prompt="plain", negative_prompt="blurry", seed=1, num_inference_steps=5, guidance_scale=4.0,
                       height=32, width=32),
        SamplingParams(prompt="with a lora on it", seed=2, num_inference_steps=5, height=48, width=32,
                       loras=[{"name": "p", "scale": 0.8}]),
        SamplingParams(prompt="first block cache", negative_prompt="dull", seed=3, num_inference_steps=8,
                       guidance_scale=5.0, height=32, width=32, cache={"policy": "fbcache", "threshold": 2.0}),
        SamplingParams(prompt="a pose", negative_prompt="blurry", seed=5, num_inference_steps=10, guidance_scale=4.0,
                       height=32, width=32,
                       controls=[{"name": "pose", "image": start_image(5, 32), "scale": 1.0}]),
    ]


@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_feature_rows_each_equal_one_process(split, one_process, strategy):
    rows = feature_rows()
    assert_each_equals_one_process(with_strategy(split, strategy), one_process, rows)
    assert one_process.generate(rows[2:3])[0].timing.cached_steps > 0  # it did skip (the same steps, above)
