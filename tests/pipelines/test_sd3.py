"""Stable Diffusion 3: served images equal diffusers' own StableDiffusion3Pipeline run alone per request with the
same seed, under every strategy and any batch company; the text rules (CLIP 77, T5 256, no T5) as diffusers has
them."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES
from stepserve.tiny.sd3 import build_tiny_sd3

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # ~350 characters: past CLIP's 77 and T5's 256 tokens
SIZES = ((32, 32), (24, 40))  # two size buckets (height, width); the tiny model's default is 32x32


@pytest.fixture(scope="module")
def sd3_path(tmp_path_factory):
    return build_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


@pytest.fixture(scope="module")
def sd3_no_t5_path(tmp_path_factory):
    return build_tiny_sd3(tmp_path_factory.mktemp("sd3_no_t5") / "pipe", with_t5=False, seed=1)


@pytest.fixture(scope="module")
def sd35_dynamic_path(tmp_path_factory):
    return build_tiny_sd3(tmp_path_factory.mktemp("sd35") / "pipe", variant="sd3.5", dynamic_shifting=True, seed=2)


def mixed_requests(n=12):
    out = []
    for i in range(n):
        out.append(SamplingParams(
            prompt=LONG_PROMPT if i == 6 else ["a red fox", "seven", "blue sky", "zz top"][i % 4] + f" {i}",
            negative_prompt="blurry, " * 20 if i == 6 else ["", "blurry", "", "low quality"][i % 4],
            seed=300 + 11 * i,
            num_inference_steps=[2, 5, 3, 7][i % 4],
            guidance_scale=[1.0, 4.5, 7.0, 0.5, 2.0][i % 5],
            sampler=("flow_euler", "dpmpp_2m")[(i // 2) % 2],
            height=SIZES[i % 3 == 2][0], width=SIZES[i % 3 == 2][1],
        ))
    return out


# The tests' own statement of the diffusers scheduler each sampler must match on SD3's config (shift 3.0), written
# out independently of stepserve.sampling.
def reference_scheduler(sampler, config):
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    if sampler == "flow_euler":
        return FlowMatchEulerDiscreteScheduler.from_config(config)
    assert sampler == "dpmpp_2m" and not config.get("use_dynamic_shifting")
    return DPMSolverMultistepScheduler(
        num_train_timesteps=1000, use_flow_sigmas=True, flow_shift=config["shift"], prediction_type="flow_prediction",
        solver_order=2, algorithm_type="dpmsolver++", solver_type="midpoint")


_PIPES: dict = {}


def diffusers_pipeline(path):
    from diffusers import StableDiffusion3Pipeline

    if str(path) not in _PIPES:
        no_t5 = not (path / "text_encoder_3").is_dir()
        # diffusers loads a folder without T5 only when told so (text_encoder_3=None), then feeds zeros for it
        kwargs = {"text_encoder_3": None, "tokenizer_3": None} if no_t5 else {}
        pipe = StableDiffusion3Pipeline.from_pretrained(path, **kwargs)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[str(path)] = (pipe, dict(pipe.scheduler.config))
    return _PIPES[str(path)][0]


def reference_image(path, p):
    """What StableDiffusion3Pipeline gives for this one request alone, with the same seed."""
    pipe = diffusers_pipeline(path)
    pipe.scheduler = reference_scheduler(p.sampler, _PIPES[str(path)][1])
    image = pipe(p.prompt, negative_prompt=p.negative_prompt or None, height=p.height, width=p.width,
                 num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                 generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def as_array(image):
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def serve(path, strategy="continuous", max_batch_size=4, memory_cap=False):
    # memory_cap measures peak memory at start-up: test_validation_names_what_sd3_allows covers it once
    return Engine.from_pretrained(str(path), strategy=strategy, max_batch_size=max_batch_size, max_queue_delay_ms=1,
                                  memory_cap=memory_cap)


@pytest.fixture(scope="module")
def references(sd3_path):
    return [reference_image(sd3_path, p) for p in mixed_requests()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_diffusers_image_and_is_batch_invariant(sd3_path, references, strategy):
    engine = serve(sd3_path, strategy, max_batch_size=8)
    results = engine.generate(mixed_requests())
    assert all(r.ok for r in results), [r.error for r in results]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, ref in zip(results, references):
        assert r.image.size == (r.params.width, r.params.height)
        diff = np.abs(as_array(r.image) - ref)
        assert diff.max() <= 1, (r.params, diff.max())

    # batch invariance: one request alone, then amid others of its size bucket
    target = SamplingParams(prompt="seven", negative_prompt="ugly", seed=5, num_inference_steps=6,
                            guidance_scale=5.0, sampler="dpmpp_2m", height=32, width=32)
    alone = engine.generate([target])[0]
    crowd = [p for p in mixed_requests(10) if (p.height, p.width) == (32, 32)]
    amid = engine.generate(crowd[:3] + [target] + crowd[3:])[3]
    assert max(amid.timing.batch_sizes) > 1 or strategy == "none"
    diff = np.abs(as_array(alone.image) - as_array(amid.image))
    assert diff.max() <= 1 and diff.mean() < 0.01


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_without_t5_gives_diffusers_image(sd3_no_t5_path, strategy):
    reqs = mixed_requests(5)
    results = serve(sd3_no_t5_path, strategy).generate(reqs)
    for r, p in zip(results, reqs):
        diff = np.abs(as_array(r.image) - reference_image(sd3_no_t5_path, p))
        assert diff.max() <= 1, (p, diff.max())


def test_sd35_with_dynamic_shift_mixed_sizes(sd35_dynamic_path):
    """Resolution-dependent shift: each size bucket has its own mu, hence its own schedule."""
    reqs = [SamplingParams(prompt=f"s{i}", seed=i, num_inference_steps=3 + i % 3, guidance_scale=3.0 * (i % 2),
                           sampler="flow_euler", height=(16, 32, 64)[i % 3], width=(32, 32, 48)[i % 3])
            for i in range(6)]
    results = serve(sd35_dynamic_path).generate(reqs)
    for r, p in zip(results, reqs):
        diff = np.abs(as_array(r.image) - reference_image(sd35_dynamic_path, p))
        assert diff.max() <= 1, (p, diff.max())


def test_the_settings_each_change_the_image(sd3_path):
    """The reference comparisons above can fail: negative prompt, guidance and sampler each change the image."""
    base = SamplingParams(prompt="a red fox", negative_prompt="", seed=1, num_inference_steps=4, guidance_scale=4.0,
                          sampler="flow_euler", height=32, width=32)
    variants = [dict(negative_prompt="blurry"), dict(guidance_scale=1.0), dict(sampler="dpmpp_2m")]
    reqs = [base] + [SamplingParams(**{**base.__dict__, **v}) for v in variants]
    images = [as_array(r.image) for r in serve(sd3_path).generate(reqs)]
    for v, image in zip(variants, images[1:]):
        assert np.abs(image - images[0]).max() > 3, v  # well past the tolerance of 1


def test_validation_names_what_sd3_allows(sd3_path):
    engine = serve(sd3_path, memory_cap=True)
    assert engine.model_info.family == "sd3" and engine.model_info.default_steps == 28
    assert engine.model_info.default_guidance_scale == 7.0 and engine.model_info.default_sampler == "flow_euler"
    with pytest.raises(ValidationError, match="flow_euler"):
        engine.generate([SamplingParams(prompt="x", sampler="euler_a")])
    with pytest.raises(ValidationError, match="multiples of 4"):
        engine.generate([SamplingParams(prompt="x", height=30, width=32)])


def test_text_conditioning_equals_encode_prompt(sd3_path, sd3_no_t5_path):
    from stepserve.pipelines.sd3 import SD3Adapter

    for path in (sd3_path, sd3_no_t5_path):
        pipe, adapter = diffusers_pipeline(path), SD3Adapter.from_pretrained(path)
        prompts = ["a cat", LONG_PROMPT, ""]
        for prompt, ours in zip(prompts, adapter.encode_prompts(prompts)):
            embeds, _, pooled, _ = pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=False)
            assert ours["encoder_hidden_states"].shape == embeds.shape == (1, 77 + 256, 128)
            torch.testing.assert_close(ours["encoder_hidden_states"], embeds, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours["pooled_projections"], pooled, atol=1e-5, rtol=1e-5)
            assert adapter.has_t5 == (path == sd3_path)
            assert bool(ours["encoder_hidden_states"][0, 77:].any()) == adapter.has_t5  # zeros without T5


def test_clip_truncates_at_77_and_t5_reads_on(sd3_path, sd3_no_t5_path):
    """Two prompts that agree on CLIP's first 77 tokens: only T5 can tell them apart."""
    from stepserve.pipelines.sd3 import SD3Adapter

    a, b = LONG_PROMPT[:150] + " red", LONG_PROMPT[:150] + " blue"
    with_t5 = SD3Adapter.from_pretrained(sd3_path).encode_prompts([a, b])
    torch.testing.assert_close(with_t5[0]["pooled_projections"], with_t5[1]["pooled_projections"])
    ea, eb = with_t5[0]["encoder_hidden_states"][0], with_t5[1]["encoder_hidden_states"][0]
    torch.testing.assert_close(ea[:77], eb[:77])
    assert (ea[77:] - eb[77:]).abs().max() > 1e-3
    no_t5 = SD3Adapter.from_pretrained(sd3_no_t5_path).encode_prompts([a, b])
    torch.testing.assert_close(no_t5[0]["encoder_hidden_states"], no_t5[1]["encoder_hidden_states"])


def test_deterministic_mode_is_byte_identical_in_any_company(sd3_path):
    """--deterministic runs every network at a fixed batch size (text encoders included), so batch company cannot
    change a single byte."""
    engine = Engine.from_pretrained(str(sd3_path), max_batch_size=2, memory_cap=False, deterministic=True)
    target = SamplingParams(prompt="seven", negative_prompt="ugly", seed=5, num_inference_steps=3,
                            guidance_scale=5.0, sampler="dpmpp_2m", height=32, width=32)
    alone = engine.generate([target])[0]
    crowd = [p for p in mixed_requests(6) if (p.height, p.width) == (32, 32)]
    amid = engine.generate(crowd[:1] + [target] + crowd[1:3])[1]
    assert max(amid.timing.batch_sizes) > 1
    assert np.array_equal(as_array(alone.image), as_array(amid.image))


def _edited_copy(src, dst, name, edit):
    import json
    import shutil

    shutil.copytree(src, dst)
    file = dst / name
    file.write_text(json.dumps(edit(json.loads(file.read_text()))))
    return dst


def test_loading_rules(sd3_path, tmp_path):
    from stepserve.pipelines.sd3 import SD3Adapter

    half_t5 = _edited_copy(sd3_path, tmp_path / "half", "model_index.json", lambda d: {**d, "tokenizer_3": [None, None]})
    with pytest.raises(ValueError, match="lists text_encoder_3 but not tokenizer_3"):
        SD3Adapter.from_pretrained(half_t5)
    # a scheduler option DPM-Solver++'s flow mode cannot reproduce: dpmpp_2m is refused at validation, not mid-run
    terminal = _edited_copy(sd3_path, tmp_path / "terminal", "scheduler/scheduler_config.json",
                            lambda d: {**d, "shift_terminal": 0.1})
    assert SD3Adapter.from_pretrained(terminal).info.samplers == ("flow_euler",)
    assert SD3Adapter.from_pretrained(sd3_path).info.samplers == ("flow_euler", "dpmpp_2m")
