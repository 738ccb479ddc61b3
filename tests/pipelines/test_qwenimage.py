"""Qwen-Image: served images equal diffusers' own QwenImagePipeline run per request alone with the same seed, under
every strategy and any batch company (prompts of different lengths, true CFG on and off, two sizes); the text
encoding, latents, schedules and the norm-preserving guidance equal the pipeline's; validation says what a request
may set."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

PROMPTS = ["a red fox", "seven", "zz top at dawn over a long quiet lake", "blue sky", "a lighthouse"]
NEGATIVES = ["", "blurry", " ", "", "low quality, washed out"]  # "" = none; " " = an empty unconditional prompt
SIZES = [(32, 32), (48, 32)]  # (height, width): 16 and 24 image tokens -> two mu values


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from stepserve.tiny.qwenimage import build_tiny_qwenimage

    return build_tiny_qwenimage(tmp_path_factory.mktemp("qwenimage") / "pipe")


_PIPES: dict = {}


def _pipe(path):
    from diffusers import QwenImagePipeline

    if str(path) not in _PIPES:
        pipe = QwenImagePipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[str(path)] = pipe
    return _PIPES[str(path)]


def reference_image(path, p: SamplingParams) -> np.ndarray:
    """What QwenImagePipeline gives for this one request alone: guidance_scale is its true_cfg_scale, and a
    negative prompt is passed only when the request has one."""
    pipe = _pipe(path)
    image = pipe(p.prompt, negative_prompt=p.negative_prompt or None, true_cfg_scale=p.guidance_scale,
                 height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def as_array(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def requests(n=10):
    return [SamplingParams(
        prompt=PROMPTS[i % len(PROMPTS)] + f" {i}",
        negative_prompt=NEGATIVES[i % len(NEGATIVES)],
        seed=300 + 17 * i,
        num_inference_steps=[2, 4, 3, 5][i % 4],
        guidance_scale=[4.0, 1.0, 6.5][i % 3],  # 1.0 with a negative prompt: no unconditional row
        height=SIZES[i % 2][0], width=SIZES[i % 2][1],
    ) for i in range(n)]


@pytest.fixture(scope="module")
def references(qwen):
    return [reference_image(qwen, p) for p in requests()]


_EXECUTORS: dict = {}


def _engine(path, strategy):
    from stepserve.engine.loading import load_executor

    if str(path) not in _EXECUTORS:
        _EXECUTORS[str(path)] = load_executor(str(path))
    return Engine(_EXECUTORS[str(path)], strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_qwenimage_pipeline_image(qwen, references, strategy):
    params = requests()
    results = _engine(qwen, strategy).generate(params)
    assert all(r.ok for r in results), [r.error for r in results]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, p, ref in zip(results, params, references):
        assert r.image.size == (p.width, p.height)
        diff = np.abs(as_array(r.image) - ref)
        assert diff.max() <= 1, (p, diff.max())


@pytest.mark.parametrize("strategy", ["continuous", "slo", "dynamic"])
def test_batch_invariance(qwen, strategy):
    engine = _engine(qwen, strategy)
    target = SamplingParams(prompt="seven", negative_prompt="blurry", seed=5, num_inference_steps=4,
                            guidance_scale=4.0, height=48, width=32)
    alone = engine.generate([target])[0]
    crowd = requests(7)
    amid = engine.generate(crowd[:3] + [target] + crowd[3:])[3]
    assert max(amid.timing.batch_sizes) > 1
    diff = np.abs(as_array(alone.image) - as_array(amid.image))
    assert diff.max() <= 1 and diff.mean() < 0.01


def test_deterministic_mode_is_byte_identical_in_any_company(qwen):
    """--deterministic pads every forward to a fixed batch size and every step's text to max_sequence_length, so
    neither the company nor the other prompts' lengths change a byte. (On this CPU a longer padding alone leaves
    the bytes as they are; kernels that tile by sequence length need the fixed length, checked directly.)"""
    engine = Engine.from_pretrained(str(qwen), max_batch_size=2, memory_cap=False, deterministic=True)
    pipeline = engine.executor.pipeline
    assert pipeline.fixed_text_length == pipeline.max_sequence_length == 512
    rows = [c.cond for c in pipeline.encode([SamplingParams(prompt=t, height=32, width=32, num_inference_steps=2,
                                                            seed=0, sampler="flow_euler", guidance_scale=1.0)
                                             for t in ("a", "a much longer prompt")])]
    batched = pipeline.collate(rows)
    assert batched["encoder_hidden_states"].shape[:2] == (2, 512)
    assert batched["encoder_hidden_states_mask"].sum(dim=1).tolist() == [r["encoder_hidden_states"].shape[1]
                                                                          for r in rows]
    target = SamplingParams(prompt="seven", negative_prompt="blurry", seed=5, num_inference_steps=3,
                            guidance_scale=5.0, height=48, width=32)
    alone = engine.generate([target])[0]
    crowd = [p for p in requests(8) if (p.height, p.width) == (48, 32)]
    amid = engine.generate(crowd[:1] + [target] + crowd[1:3])[1]
    assert max(amid.timing.batch_sizes) > 1
    assert np.array_equal(as_array(alone.image), as_array(amid.image))
    assert np.abs(as_array(alone.image) - reference_image(qwen, target)).max() <= 1


def test_model_info_and_validation(qwen):
    from stepserve.pipelines.qwenimage import QwenImageAdapter

    engine = Engine.from_pretrained(str(qwen), max_batch_size=2, memory_cap=False)
    assert isinstance(engine.executor.pipeline, QwenImageAdapter)  # chosen from model_index.json's _class_name
    info = engine.model_info
    assert (info.family, info.guidance, info.negative_prompt) == ("qwenimage", "cfg", True)
    assert info.size_multiple == 8  # vae scale 4 x the 2x2 patches
    assert info.samplers == ("flow_euler",) and info.default_guidance_scale == 4.0
    assert info.default_steps == 8  # the tiny folder's stepserve.json
    with pytest.raises(ValidationError, match="height.*multiples of 8"):
        engine.generate([SamplingParams(prompt="a", height=36)])
    with pytest.raises(ValidationError, match="sampler.*allowed: flow_euler$"):
        engine.generate([SamplingParams(prompt="a", sampler="dpmpp_2m")])


def test_memory_probe_measures_the_guided_rows(qwen, monkeypatch):
    """Qwen-Image runs its unconditional row only with a negative prompt: the memory cap's probe requests carry
    one, so the peak it measures is that of two rows per request (and fbcache's state, which the family runs)."""
    from stepserve import profiling
    from stepserve.engine.loading import load_executor

    executor = load_executor(str(qwen))
    seen = []
    prepare = executor.prepare

    def spy(requests):
        out = prepare(requests)
        seen.extend((r.conditioning.guided, r.params.cache) for r in requests)
        return out

    monkeypatch.setattr(executor, "prepare", spy)
    profiling.measure_peak_memory(executor, [1, 2])
    assert seen and all(guided for guided, _ in seen), seen
    assert all(cache is not None and cache.policy == "fbcache" for _, cache in seen)


def test_encoding_latents_and_schedules_follow_the_pipeline(qwen):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import (
        calculate_shift,
        retrieve_timesteps,
    )

    from stepserve.pipelines.qwenimage import QwenImageAdapter

    adapter = QwenImageAdapter.from_pretrained(qwen)
    pipe = _pipe(qwen)
    short, long = "a", PROMPTS[2]
    ours = adapter.encode_prompts([short, long])
    assert ours[0].shape[0] < ours[1].shape[0]  # each prompt its own length
    for prompt, embeds in zip([short, long], ours):
        want, mask = pipe.encode_prompt(prompt, device="cpu")
        assert mask is None  # one prompt: no padding
        assert torch.equal(embeds, want[0])  # encoded alone, as the pipeline does
    config = pipe.scheduler.config
    mus = []
    for height, width in SIZES:
        params = SamplingParams(prompt="a", seed=3, num_inference_steps=5, height=height, width=width,
                                sampler="flow_euler", guidance_scale=4.0)
        want = pipe.prepare_latents(1, 4, height, width, torch.float32, "cpu", torch.Generator("cpu").manual_seed(3))
        assert torch.equal(adapter.initial_latents(params, torch.Generator("cpu").manual_seed(3)), want)
        cond = adapter.encode([params])[0]
        assert cond.uncond is None  # no negative prompt: no unconditional row, whatever guidance_scale says
        mu = calculate_shift(want.shape[1], config["base_image_seq_len"], config["max_image_seq_len"],
                             config["base_shift"], config["max_shift"])
        timesteps, _ = retrieve_timesteps(type(pipe.scheduler).from_config(config), 5, "cpu",
                                          sigmas=np.linspace(1.0, 1 / 5, 5), mu=mu)
        schedule = adapter.schedule(params)
        assert schedule.timesteps == tuple(timesteps.tolist())
        mus.append(schedule.mu)
    assert mus[0] != mus[1]  # two sizes, two schedules (shift_terminal applied by the scheduler itself)
    guided = adapter.encode([SamplingParams(prompt="a", negative_prompt="b", guidance_scale=1.5, height=32,
                                            width=32, num_inference_steps=2, seed=1, sampler="flow_euler")])[0]
    assert guided.uncond is not None


def test_guidance_keeps_the_conditional_norm_per_token(qwen):
    from stepserve.pipelines.qwenimage import QwenImageAdapter

    adapter = QwenImageAdapter.from_pretrained(qwen)
    g = torch.Generator().manual_seed(0)
    cond, uncond = torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 16, generator=g)
    scale = torch.tensor([4.0, 1.5]).view(-1, 1, 1)
    out = adapter.combine_guidance(cond, uncond, scale)
    mixed = uncond + scale * (cond - uncond)
    torch.testing.assert_close(out.norm(dim=-1), cond.norm(dim=-1))
    torch.testing.assert_close(out / out.norm(dim=-1, keepdim=True), mixed / mixed.norm(dim=-1, keepdim=True))


def test_http_serves_qwenimage_with_a_negative_prompt(qwen):
    import base64
    import io

    from fastapi.testclient import TestClient
    from PIL import Image

    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.server.app import create_app

    _engine(qwen, "continuous")
    app = create_app(AsyncEngine(_EXECUTORS[str(qwen)], strategy="continuous", max_batch_size=2))
    body = {"prompt": "a red fox", "negative_prompt": "blurry", "size": "32x48", "seed": 4,
            "num_inference_steps": 3, "guidance_scale": 5.0}
    with TestClient(app) as http:
        ok = http.post("/v1/images/generations", json=body)
    assert ok.status_code == 200, ok.text
    image = Image.open(io.BytesIO(base64.b64decode(ok.json()["data"][0]["b64_json"])))
    want = reference_image(qwen, SamplingParams(prompt="a red fox", negative_prompt="blurry", seed=4,
                                                num_inference_steps=3, guidance_scale=5.0, height=48, width=32))
    assert np.abs(as_array(image) - want).max() <= 1
