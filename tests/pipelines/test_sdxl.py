"""SDXL served by stepserve equals diffusers' StableDiffusionXLPipeline run alone per request (same seed), under
every batching strategy, on a tiny random SDXL folder built offline."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from tiny_sd import SCHEDULER_CLASS

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.engine.loading import load_executor
from stepserve.pipelines.vae import vae_dtype
from stepserve.pipelines.sdxl import StableDiffusionXLAdapter

LONG = "a very long prompt about a lighthouse on a cliff over a stormy sea at night with rain and waves, " * 2

# Mixed: steps, guidance (<= 1: no CFG row; > 1: CFG), two size buckets (16x16, 24x16), every SD sampler, with
# and without negative prompts, a prompt past CLIP's 77 tokens (truncated as diffusers does), a repeated prompt.
REQUESTS = [
    SamplingParams(prompt="a red fox", seed=1, num_inference_steps=3, guidance_scale=5.0, sampler="euler"),
    SamplingParams(prompt="blue sky", negative_prompt="clouds", seed=2, num_inference_steps=4, guidance_scale=3.0,
                   sampler="ddim", height=24),
    SamplingParams(prompt="x", seed=3, num_inference_steps=2, guidance_scale=1.0, sampler="dpmpp_2m"),
    SamplingParams(prompt=LONG, seed=4, num_inference_steps=3, guidance_scale=6.0, sampler="euler_a", height=24),
    SamplingParams(prompt="tree", seed=5, num_inference_steps=3, guidance_scale=0.5, sampler="euler", height=24),
    SamplingParams(prompt="tree", negative_prompt="dark", seed=6, num_inference_steps=3, guidance_scale=7.5,
                   sampler="dpmpp_2m"),
    SamplingParams(prompt="ocean", seed=7, num_inference_steps=4, guidance_scale=2.0, sampler="ddim"),
    SamplingParams(prompt="ocean", negative_prompt=LONG, seed=8, num_inference_steps=2, guidance_scale=4.0,
                   sampler="euler_a", height=24),
    SamplingParams(prompt="a red fox", seed=9, num_inference_steps=3, guidance_scale=1.0, sampler="ddim", height=24),
    SamplingParams(prompt="night city", negative_prompt="day", seed=10, num_inference_steps=4, guidance_scale=5.0,
                   sampler="euler"),
]


@pytest.fixture(scope="module")
def sdxl_path(tmp_path_factory):
    from stepserve.tiny.sdxl import build_tiny_sdxl

    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny_sdxl") / "pipe")


@pytest.fixture(scope="module")
def reference_pipe(sdxl_path):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_path, add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_image(pipe, p: SamplingParams) -> np.ndarray:
    """StableDiffusionXLPipeline for one request, alone; no negative prompt -> None, as a caller would pass it."""
    import diffusers

    pipe.scheduler = getattr(diffusers, SCHEDULER_CLASS[p.sampler]).from_config(pipe.scheduler.config)
    image = pipe(p.prompt, negative_prompt=p.negative_prompt or None, height=p.height or 16, width=p.width or 16,
                 num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                 generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np").images[0]
    return (image * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def references(reference_pipe):
    return [reference_image(reference_pipe, p) for p in REQUESTS]


@pytest.fixture(scope="module")
def executor(sdxl_path):
    return load_executor(str(sdxl_path))


def _pixels(result) -> np.ndarray:
    assert result.ok, result.error
    return np.asarray(result.image.convert("RGB"), dtype=np.int16)


@pytest.fixture(scope="module")
def served(executor):
    """Every strategy's images, and the batch sizes its requests saw."""
    out = {}
    for strategy in ("none", "static", "dynamic", "continuous"):
        engine = Engine(executor, strategy=strategy, max_batch_size=4, max_queue_delay_ms=1, static_batch_size=3)
        results = engine.generate(list(REQUESTS))
        out[strategy] = ([_pixels(r) for r in results], [max(r.timing.batch_sizes) for r in results])
    return out


def test_folder_loads_as_sdxl_with_its_rules(executor):
    assert isinstance(executor.pipeline, StableDiffusionXLAdapter)
    info = executor.model_info
    assert (info.family, info.guidance, info.negative_prompt) == ("sdxl", "cfg", True)
    assert info.default_guidance_scale == 5.0  # StableDiffusionXLPipeline's default
    assert (info.default_height, info.min_size, info.max_size, info.size_multiple) == (16, 8, 32, 4)


@pytest.mark.parametrize("strategy", ["none", "static", "dynamic", "continuous"])
def test_every_strategy_matches_diffusers_per_request(served, references, strategy):
    images, _ = served[strategy]
    for i, (got, want) in enumerate(zip(images, references)):
        assert got.shape == want.shape, i
        assert np.abs(got - want).max() <= 1, f"request {i}: {REQUESTS[i]}"


def test_batch_invariance(served):
    alone, sizes = served["none"]
    assert max(sizes) == 1
    for strategy in ("static", "dynamic", "continuous"):
        images, batch_sizes = served[strategy]
        assert max(batch_sizes) > 1, strategy  # requests did share forwards
        for a, b in zip(alone, images):
            assert np.abs(a - b).max() <= 1, strategy


def test_conditioning_follows_diffusers_defaults(executor):
    adapter = executor.pipeline
    p = SamplingParams(prompt="tree", seed=0, num_inference_steps=2, guidance_scale=5.0, sampler="euler",
                       height=24, width=16)
    (c,) = adapter.encode([p])
    assert c.cond["time_ids"].tolist() == [[24.0, 16.0, 0.0, 0.0, 24.0, 16.0]]  # original + crop (0,0) + target
    assert torch.equal(c.uncond["time_ids"], c.cond["time_ids"])  # negative sizes default to the positive ones
    # no negative prompt + force_zeros_for_empty_prompt: zero unconditional embeddings, pooled ones included
    assert not c.uncond["encoder_hidden_states"].any() and not c.uncond["text_embeds"].any()
    assert c.cond["encoder_hidden_states"].shape == (1, 77, 64) and c.cond["text_embeds"].shape == (1, 32)
    (no_cfg,) = adapter.encode([replace(p, guidance_scale=1.0)])
    assert no_cfg.uncond is None


def test_without_force_zeros_the_empty_negative_prompt_is_encoded(executor, reference_pipe):
    adapter = executor.pipeline
    p = replace(REQUESTS[0], seed=11, height=16, width=16)
    adapter.force_zeros_for_empty_prompt = False
    reference_pipe.register_to_config(force_zeros_for_empty_prompt=False)
    try:
        (c,) = adapter.encode([p])
        assert c.uncond["encoder_hidden_states"].any()
        got = _pixels(Engine(executor, strategy="continuous").generate([p])[0])
        want = reference_image(reference_pipe, p)
    finally:
        adapter.force_zeros_for_empty_prompt = True
        reference_pipe.register_to_config(force_zeros_for_empty_prompt=True)
    assert np.abs(got - want).max() <= 1


def test_sizes_outside_the_buckets_name_what_is_allowed(executor):
    with pytest.raises(ValidationError, match=r"height: \d+x18 \(width x height\) is not supported: height 18 is not a "
                                              r"multiple of 4; allowed: width and height multiples of 4 from 8 to 32"):
        Engine(executor).generate([SamplingParams(prompt="x", height=18)])
    with pytest.raises(ValidationError, match="sampler: 'flow_euler' is not supported; allowed: ddim, euler"):
        Engine(executor).generate([SamplingParams(prompt="x", sampler="flow_euler")])


def test_float16_keeps_a_force_upcast_vae_in_float32():
    from types import SimpleNamespace

    assert vae_dtype(SimpleNamespace(force_upcast=True), torch.float16) == torch.float32
    assert vae_dtype(SimpleNamespace(force_upcast=False), torch.float16) == torch.float16
    assert vae_dtype(SimpleNamespace(force_upcast=True), torch.bfloat16) == torch.bfloat16


def test_onnxruntime_refuses_sdxl_by_name(sdxl_path):
    with pytest.raises(ValueError, match="serves StableDiffusionPipeline folders only; .* StableDiffusionXLPipeline"):
        load_executor(str(sdxl_path), backend="onnxruntime")
