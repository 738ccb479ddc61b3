"""Flux.2 [klein]: served images equal diffusers' own Flux2KleinPipeline run per request alone with the same seed,
under every strategy and any batch company (guidance on and off, two sizes, two samplers, several step counts: the
schedule's shift depends on both); the text encoding, patchified latents, schedules and the batch-norm decode equal
the pipeline's; a step-distilled folder ignores guidance; validation says what a request may set."""

import numpy as np
import pytest
import torch
from flux2_reference import (
    as_array,
    check,
    executor,
    flux2_pipe,
    flux2_scheduler,
    reference_image,
    shared_engine,
)

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

PROMPTS = ["a red fox", "seven", "zz top at dawn over a long quiet lake", "blue sky", "a lighthouse"]
SIZES = [(32, 32), (48, 32)]  # (height, width): 64 and 96 image tokens


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    from stepserve.tiny.flux2 import build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("flux2") / "pipe")


@pytest.fixture(scope="module")
def klein_distilled(tmp_path_factory):
    from stepserve.tiny.flux2 import build_tiny_flux2

    return build_tiny_flux2(tmp_path_factory.mktemp("flux2_distilled") / "pipe", seed=1, distilled=True)


def requests(n=10):
    return [SamplingParams(
        prompt=PROMPTS[i % len(PROMPTS)] + f" {i}",
        seed=500 + 13 * i,
        num_inference_steps=[2, 4, 3, 5][i % 4],
        guidance_scale=[4.0, 1.0, 2.5][i % 3],  # 1.0: no unconditional row
        sampler=("flow_euler", "dpmpp_2m")[(i // 2) % 2],
        height=SIZES[i % 2][0], width=SIZES[i % 2][1],
    ) for i in range(n)]


@pytest.fixture(scope="module")
def references(klein):
    return [reference_image(klein, p) for p in requests()]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_flux2_klein_pipeline_image(klein, references, strategy):
    params = requests()
    check(shared_engine(klein, strategy).generate(params), params, references, strategy)


def test_distilled_ignores_guidance(klein_distilled):
    params = [SamplingParams(prompt=PROMPTS[i], seed=40 + i, num_inference_steps=[2, 4, 3][i],
                             guidance_scale=[1.0, 4.0, 6.0][i], sampler="flow_euler", height=32, width=32)
              for i in range(3)]
    results = shared_engine(klein_distilled, "continuous").generate(params)
    check(results, params, [reference_image(klein_distilled, p) for p in params], "continuous")
    assert not any(c.guided for c in executor(klein_distilled).pipeline.encode(params))


@pytest.mark.parametrize("strategy", ["continuous", "slo", "dynamic"])
def test_batch_invariance(klein, strategy):
    served = shared_engine(klein, strategy)
    target = SamplingParams(prompt="seven", seed=5, num_inference_steps=4, guidance_scale=4.0, sampler="dpmpp_2m",
                            height=48, width=32)
    alone = served.generate([target])[0]
    crowd = requests(7)
    amid = served.generate(crowd[:3] + [target] + crowd[3:])[3]
    assert max(amid.timing.batch_sizes) > 1
    diff = np.abs(as_array(alone.image) - as_array(amid.image))
    assert diff.max() <= 1 and diff.mean() < 0.01


def test_deterministic_mode_is_byte_identical_in_any_company(klein):
    engine = Engine.from_pretrained(str(klein), max_batch_size=2, memory_cap=False, deterministic=True)
    target = SamplingParams(prompt="seven", seed=5, num_inference_steps=3, guidance_scale=3.0, sampler="flow_euler",
                            height=48, width=32)
    alone = engine.generate([target])[0]
    crowd = [p for p in requests(8) if (p.height, p.width) == (48, 32)]
    amid = engine.generate(crowd[:1] + [target] + crowd[1:3])[1]
    assert max(amid.timing.batch_sizes) > 1
    assert np.array_equal(as_array(alone.image), as_array(amid.image))
    assert np.abs(as_array(alone.image) - reference_image(klein, target)).max() <= 1


def test_model_info_and_validation(klein):
    from stepserve.pipelines.flux2 import Flux2Adapter

    engine = Engine.from_pretrained(str(klein), max_batch_size=2, memory_cap=False)
    assert isinstance(engine.executor.pipeline, Flux2Adapter)
    info = engine.model_info
    assert (info.family, info.guidance, info.negative_prompt) == ("flux2", "cfg", False)
    assert info.size_multiple == 4 and info.samplers == ("flow_euler", "dpmpp_2m")
    assert info.default_guidance_scale == 4.0 and info.default_steps == 8
    with pytest.raises(ValidationError, match="negative_prompt"):
        engine.generate([SamplingParams(prompt="a", negative_prompt="blurry")])
    with pytest.raises(ValidationError, match="height.*multiples of 4"):
        engine.generate([SamplingParams(prompt="a", height=34)])


def test_encoding_latents_and_schedules_follow_the_pipeline(klein):
    from diffusers.pipelines.flux2.pipeline_flux2_klein import (
        compute_empirical_mu,
        retrieve_timesteps,
    )

    from stepserve.pipelines.flux2 import Flux2Adapter

    adapter = Flux2Adapter.from_pretrained(klein)
    pipe, config = flux2_pipe(klein)
    for prompt, embeds in zip(["a", PROMPTS[2]], adapter.encode_prompts(["a", PROMPTS[2]])):
        want, text_ids = pipe.encode_prompt(prompt, device="cpu")
        assert embeds.shape == (512, 48) and torch.equal(embeds, want[0])
        assert text_ids[0, :, 3].tolist() == list(range(512)) and not text_ids[0, :, :3].any()
    mus = set()
    for (height, width), steps in zip(SIZES * 2, (3, 3, 7, 7)):
        params = SamplingParams(prompt="a", seed=3, num_inference_steps=steps, height=height, width=width,
                                sampler="flow_euler", guidance_scale=4.0)
        want, want_ids = pipe.prepare_latents(1, 4, height, width, torch.float32, "cpu",
                                              torch.Generator("cpu").manual_seed(3))
        got = adapter.initial_latents(params, torch.Generator("cpu").manual_seed(3))
        assert torch.equal(got, want)
        h, w = adapter.grid(height, width)
        assert torch.equal(adapter.unpack_latents(got, (height, width)),
                           pipe._unpack_latents_with_ids(want, want_ids, h // 2, w // 2))
        mu = compute_empirical_mu(want.shape[1], steps)
        scheduler = flux2_scheduler("flow_euler", config)
        timesteps, _ = retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        schedule = adapter.schedule(params)
        assert schedule.timesteps == tuple(timesteps.tolist()) and schedule.mu == mu
        mus.add(mu)
    assert len(mus) == 4  # the shift moves with the size and with the step count
