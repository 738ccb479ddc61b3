"""Flux.2 [dev]: served images equal diffusers' own Flux2Pipeline run per request alone with the same seed, under
every strategy and any batch company (guidance values embedded per row, two sizes, two samplers, several step
counts); the Mistral-3 text encoding (system message, chat template, layers 10/20/30 stacked) equals the
pipeline's; a request is one row whatever its guidance; validation says what a request may set."""

import numpy as np
import pytest
import torch
from flux2_reference import (
    as_array,
    check,
    executor,
    flux2_pipe,
    reference_image,
    shared_engine,
)

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

PROMPTS = ["a red fox", "seven", "zz top at dawn over a long quiet lake", "blue [IMG]sky", "a lighthouse"]
SIZES = [(32, 32), (48, 32)]  # (height, width): 64 and 96 image tokens


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    from stepserve.tiny.flux2 import build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("flux2_dev") / "pipe", variant="dev")


def requests(n=10):
    return [SamplingParams(
        prompt=PROMPTS[i % len(PROMPTS)] + f" {i}",
        seed=700 + 11 * i,
        num_inference_steps=[2, 4, 3, 5][i % 4],
        guidance_scale=[4.0, 1.0, 2.5][i % 3],  # each value in its own row of the same forward
        sampler=("flow_euler", "dpmpp_2m")[(i // 2) % 2],
        height=SIZES[i % 2][0], width=SIZES[i % 2][1],
    ) for i in range(n)]


@pytest.fixture(scope="module")
def references(dev):
    return [reference_image(dev, p) for p in requests()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_flux2_pipeline_image(dev, references, strategy):
    params = requests()
    check(shared_engine(dev, strategy).generate(params), params, references, strategy)


@pytest.mark.parametrize("strategy", ["continuous", "slo", "dynamic"])
def test_batch_invariance(dev, strategy):
    served = shared_engine(dev, strategy)
    target = SamplingParams(prompt="seven", seed=5, num_inference_steps=4, guidance_scale=3.0, sampler="dpmpp_2m",
                            height=48, width=32)
    alone = served.generate([target])[0]
    crowd = requests(7)
    amid = served.generate(crowd[:3] + [target] + crowd[3:])[3]
    assert max(amid.timing.batch_sizes) > 1
    diff = np.abs(as_array(alone.image) - as_array(amid.image))
    assert diff.max() <= 1 and diff.mean() < 0.01


def test_deterministic_mode_is_byte_identical_in_any_company(dev):
    engine = Engine.from_pretrained(str(dev), max_batch_size=2, memory_cap=False, deterministic=True)
    target = SamplingParams(prompt="seven", seed=5, num_inference_steps=3, guidance_scale=3.0, sampler="flow_euler",
                            height=48, width=32)
    alone = engine.generate([target])[0]
    crowd = [p for p in requests(8) if (p.height, p.width) == (48, 32)]
    amid = engine.generate(crowd[:1] + [target] + crowd[1:3])[1]
    assert max(amid.timing.batch_sizes) > 1
    assert np.array_equal(as_array(alone.image), as_array(amid.image))
    assert np.abs(as_array(alone.image) - reference_image(dev, target)).max() <= 1


def test_guidance_is_embedded_one_row_per_request(dev):
    """Every request is one conditional row carrying its guidance value (float32), and the value changes the
    image (it reaches the transformer's guidance embedding)."""
    pipeline = executor(dev).pipeline
    params = [SamplingParams(prompt="a", guidance_scale=g, height=32, width=32) for g in (1.0, 6.0)]
    conditionings = pipeline.encode(params)
    assert not any(c.guided for c in conditionings)
    assert [c.cond["guidance"].tolist() for c in conditionings] == [[1.0], [6.0]]
    assert all(c.cond["guidance"].dtype == torch.float32 for c in conditionings)
    images = shared_engine(dev, "continuous").generate(
        [SamplingParams(prompt="a", seed=3, num_inference_steps=3, guidance_scale=g, sampler="flow_euler",
                        height=32, width=32) for g in (1.0, 6.0)])
    assert np.abs(as_array(images[0].image) - as_array(images[1].image)).max() > 4


def test_model_info_and_validation(dev):
    from stepserve.pipelines.flux2_dev import Flux2DevAdapter
    from stepserve.pipelines.registry import adapter_class

    assert adapter_class("Flux2Pipeline") is Flux2DevAdapter
    engine = Engine.from_pretrained(str(dev), max_batch_size=2, memory_cap=False)
    assert isinstance(engine.executor.pipeline, Flux2DevAdapter)
    info = engine.model_info
    assert (info.family, info.guidance, info.negative_prompt, info.img2img) == ("flux2", "embedded", False, False)
    assert info.size_multiple == 4 and info.samplers == ("flow_euler", "dpmpp_2m")
    assert info.default_guidance_scale == 4.0 and info.default_steps == 8
    with pytest.raises(ValidationError, match=r"negative_prompt: .*\(flux2\) takes no negative prompt; allowed: empty"):
        engine.generate([SamplingParams(prompt="a", negative_prompt="blurry")])
    with pytest.raises(ValidationError, match="guidance_scale: .*guidance embedding"):
        engine.generate([SamplingParams(prompt="a", guidance_scale=-1.0)])
    with pytest.raises(ValidationError, match="image: .*does not start from an image"):
        engine.generate([SamplingParams(prompt="a", image=np.zeros((32, 32, 3), dtype=np.uint8))])
    with pytest.raises(ValidationError, match="height.*multiples of 4"):
        engine.generate([SamplingParams(prompt="a", height=34)])


def test_text_encoding_follows_the_pipeline(dev):
    """System message, chat template, "[IMG]" removed, layers 10, 20, 30 stacked: equal to Flux2Pipeline's
    encode_prompt (and not to the stack of any other layers)."""
    from stepserve.pipelines.flux2_dev import Flux2DevAdapter

    adapter = Flux2DevAdapter.from_pretrained(dev)
    assert adapter.text_layers == (10, 20, 30)
    pipe, _ = flux2_pipe(dev)
    prompts = ["a", PROMPTS[2], PROMPTS[3]]
    for prompt, embeds in zip(prompts, adapter.encode_prompts(prompts)):
        want, text_ids = pipe.encode_prompt(prompt, device="cpu")
        assert embeds.shape == (512, 48) and torch.equal(embeds, want[0])
        assert text_ids[0, :, 3].tolist() == list(range(512)) and not text_ids[0, :, :3].any()
        other, _ = pipe.encode_prompt(prompt, device="cpu", text_encoder_out_layers=(9, 18, 27))
        assert not torch.allclose(embeds, other[0])
    input_ids, mask = adapter.tokenize("blue [IMG]sky")
    text = adapter.tokenizer.decode(input_ids[0][mask[0].bool()])
    assert "blue sky" in text and text.count("[IMG]") == 0 and "[SYSTEM_PROMPT]" in text


def test_text_layers_from_stepserve_json_are_checked_at_load(dev, tmp_path):
    import json
    import shutil

    from stepserve.pipelines.flux2_dev import Flux2DevAdapter

    folder = shutil.copytree(dev, tmp_path / "dev")
    serving = json.loads((folder / "stepserve.json").read_text())
    (folder / "stepserve.json").write_text(json.dumps({**serving, "text_encoder_out_layers": [10, 20, 40]}))
    with pytest.raises(ValueError, match=r"text_encoder_out_layers \[10, 20, 40\]: the text encoder has 32 layers; "
                                         r"allowed: one or more of 0\.\.32"):
        Flux2DevAdapter.from_pretrained(folder)
    (folder / "stepserve.json").write_text(json.dumps({**serving, "text_encoder_out_layers": [1, 2, 3]}))
    assert Flux2DevAdapter.from_pretrained(folder).text_layers == (1, 2, 3)
