"""Tiny Flux.2 [klein] with --ulysses-degree 2 on the CPU (two gloo ranks): its plan splits the image and text
tokens and their position ids (given in the shape it splits); requests of mixed sizes, steps, guidance and samplers
sent together equal diffusers' Flux2KleinPipeline run alone (uint8 within 1), and a LoRA row in the same batches
equals itself served by one process."""

import pytest
from flux2_reference import reference_image
from sequence_cases import assert_each_equals_one_process, split_engine, with_strategy
from served_equal import assert_served_equal

from stepserve import Engine, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("batching_pays")]  # two ranks start: seconds


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    from stepserve.tiny.flux2 import build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("flux2_sequence") / "pipe")


@pytest.fixture(scope="module")
def split(klein):
    with split_engine(klein) as engine:
        yield engine


def mixed(n=4, **extra):
    return [SamplingParams(prompt=["a red fox", "seven", "zz top at dawn", "blue sky"][i % 4] + f" {i}",
                           seed=500 + 13 * i, num_inference_steps=[2, 4, 3][i % 3],
                           guidance_scale=[4.0, 1.0, 2.5][i % 3], sampler=("flow_euler", "dpmpp_2m")[(i // 2) % 2],
                           height=[32, 48][i % 2], width=32, **extra) for i in range(n)]


@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_mixed_requests_equal_diffusers_pipeline(klein, split, strategy):
    params = mixed()
    results = with_strategy(split, strategy).generate(params)
    assert_served_equal(results, params, [reference_image(klein, p) for p in params], strategy)


def test_a_lora_row_equals_one_process(klein, split, tmp_path):
    from stepserve.tiny.lora import build_tiny_lora

    from extras import require

    require("peft", "lora")
    lora = build_tiny_lora(klein, tmp_path / "p.safetensors", seed=1, rank=4, std=0.3)
    one = Engine.from_pretrained(str(klein), strategy="continuous", memory_cap=False, max_batch_size=8)
    for engine in (one, split):
        engine.executor.adapters().load("p", lora)
    rows = mixed(3) + mixed(2, loras=[{"name": "p", "scale": 0.8}])
    assert_each_equals_one_process(split, one, rows)
