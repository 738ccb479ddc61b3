"""Flux.1 (dev and schnell): served images equal diffusers' own FluxPipeline run per request alone with the same
seed, under every strategy and any batch company; the text encoding, latent packing, image ids and per-size
schedules equal the pipeline's; validation says what a Flux request may set."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

LONG_PROMPT = ("a watercolor of a lighthouse on a cliff at dusk, gulls over the waves, wet rocks and moss below, "
               "a lantern glowing in the top window")  # > 77 CLIP tokens (one per character here), < 512 T5 tokens
PROMPTS = ["a red fox", "seven", "zz top at dawn", LONG_PROMPT, "blue sky"]
SIZES = [(32, 32), (48, 32)]  # (height, width): 64 and 96 image tokens -> two mu values on dev


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("flux_dev") / "pipe", variant="dev")


@pytest.fixture(scope="module")
def flux_schnell(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("flux_schnell") / "pipe", variant="schnell", seed=1)


_PIPES: dict = {}


def _pipe(path):
    from diffusers import FluxPipeline

    if str(path) not in _PIPES:
        pipe = FluxPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[str(path)] = (pipe, dict(pipe.scheduler.config))
    return _PIPES[str(path)]


def _scheduler(sampler: str, config: dict):
    """The diffusers scheduler each sampler name stands for on a flow model (the tests' own statement):
    flow_euler is the folder's FlowMatchEulerDiscreteScheduler; dpmpp_2m is DPM-Solver++(2M) with flow sigmas
    and velocity prediction, built from the same config (its use_dynamic_shifting carries over)."""
    import diffusers

    if sampler == "flow_euler":
        return diffusers.FlowMatchEulerDiscreteScheduler.from_config(config)
    assert sampler == "dpmpp_2m"
    return diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=config["num_train_timesteps"], use_flow_sigmas=True, prediction_type="flow_prediction",
        flow_shift=config["shift"], use_dynamic_shifting=config["use_dynamic_shifting"], solver_order=2,
        algorithm_type="dpmsolver++", solver_type="midpoint")


def reference_image(path, p: SamplingParams) -> np.ndarray:
    """What FluxPipeline gives for this one request alone (its defaults for everything the request leaves out)."""
    pipe, config = _pipe(path)
    pipe.scheduler = _scheduler(p.sampler, config)
    image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def as_array(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def dev_requests(n=12):
    return [SamplingParams(
        prompt=PROMPTS[i % len(PROMPTS)] + f" {i}",
        seed=2000 + 31 * i,
        num_inference_steps=[2, 4, 3, 5, 3, 2][i % 6],
        guidance_scale=[3.5, 1.0, 6.0][i % 3],  # the embedded guidance value (1.0 is a value too, not "off")
        sampler=("flow_euler", "dpmpp_2m")[(i // 2) % 2],
        height=SIZES[i % 2][0], width=SIZES[i % 2][1],
    ) for i in range(n)]


def schnell_requests():
    return [SamplingParams(prompt=PROMPTS[i] + " quick", seed=70 + i, num_inference_steps=[1, 4, 2, 3][i],
                           guidance_scale=[0.0, 3.5, 1.0, 7.0][i], sampler="flow_euler", height=SIZES[i % 2][0],
                           width=SIZES[i % 2][1]) for i in range(4)]


@pytest.fixture(scope="module")
def dev_references(flux_dev):
    return [reference_image(flux_dev, p) for p in dev_requests()]


_EXECUTORS: dict = {}


def _engine(path, strategy):
    """An engine on the folder's executor, loaded once per folder (Engine.from_pretrained is tested below)."""
    from stepserve.engine.loading import load_executor

    if str(path) not in _EXECUTORS:
        _EXECUTORS[str(path)] = load_executor(str(path))
    return Engine(_EXECUTORS[str(path)], strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)


def _check(results, params, references, strategy):
    assert all(r.ok for r in results), [r.error for r in results]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, p, ref in zip(results, params, references):
        diff = np.abs(as_array(r.image) - ref)
        assert r.image.size == (p.width, p.height)
        assert diff.max() <= 1, (p, diff.max())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dev_every_strategy_gives_flux_pipeline_image(flux_dev, dev_references, strategy):
    results = _engine(flux_dev, strategy).generate(dev_requests())
    _check(results, dev_requests(), dev_references, strategy)


@pytest.mark.parametrize("strategy", ["continuous", "static"])
def test_schnell_gives_flux_pipeline_image(flux_schnell, strategy):
    params = schnell_requests()
    results = _engine(flux_schnell, strategy).generate(params)
    _check(results, params, [reference_image(flux_schnell, p) for p in params], strategy)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_invariance(flux_dev, strategy):
    engine = _engine(flux_dev, strategy)
    target = SamplingParams(prompt="seven", seed=5, num_inference_steps=4, guidance_scale=4.0, sampler="dpmpp_2m",
                            height=48, width=32)
    alone = engine.generate([target])[0]
    crowd = dev_requests(7)
    amid = engine.generate(crowd[:3] + [target] + crowd[3:])[3]
    assert max(amid.timing.batch_sizes) > 1 or strategy == "none"
    diff = np.abs(as_array(alone.image) - as_array(amid.image))
    assert diff.max() <= 1 and diff.mean() < 0.01


def test_model_info_and_loading(flux_dev, flux_schnell):
    from stepserve.pipelines.flux import FluxAdapter

    dev, schnell = (Engine.from_pretrained(str(p), max_batch_size=4) for p in (flux_dev, flux_schnell))
    assert isinstance(dev.executor.pipeline, FluxAdapter)  # chosen from model_index.json's _class_name
    info = dev.model_info
    assert (info.family, info.guidance, info.negative_prompt) == ("flux", "embedded", False)
    assert info.size_multiple == 4  # vae scale 2 x the 2x2 patches
    assert info.samplers == ("flow_euler", "dpmpp_2m") and info.default_steps == 28
    assert info.default_guidance_scale == 3.5  # FluxPipeline's defaults
    # schnell: a fixed shift (FluxPipeline hands DPM-Solver a mu, which it takes only with dynamic shifting)
    assert schnell.model_info.samplers == ("flow_euler",) and schnell.model_info.default_steps == 4  # its stepserve.json


def test_validation_says_what_flux_allows(flux_dev, flux_schnell):
    engine = _engine(flux_dev, "continuous")
    with pytest.raises(ValidationError, match="negative_prompt.*no negative prompt"):
        engine.generate([SamplingParams(prompt="a", negative_prompt="blurry")])
    with pytest.raises(ValidationError, match="height.*multiples of 4"):
        engine.generate([SamplingParams(prompt="a", height=34)])
    with pytest.raises(ValidationError, match="sampler.*allowed: flow_euler, dpmpp_2m"):
        engine.generate([SamplingParams(prompt="a", sampler="euler")])
    with pytest.raises(ValidationError, match="sampler.*allowed: flow_euler$"):
        _engine(flux_schnell, "continuous").generate([SamplingParams(prompt="a", sampler="dpmpp_2m")])


def test_text_encoding_equals_encode_prompt(flux_dev):
    from stepserve.pipelines.flux import FluxAdapter

    pipe, _ = _pipe(flux_dev)
    adapter = FluxAdapter.from_pretrained(flux_dev)
    prompts = ["a red fox", LONG_PROMPT]
    assert len(pipe.tokenizer(LONG_PROMPT).input_ids) > 77  # CLIP truncates it; T5 (512) does not
    ours = adapter.encode_prompts(prompts)
    for prompt, (embeds, pooled) in zip(prompts, ours):
        want_embeds, want_pooled, text_ids = pipe.encode_prompt(prompt, prompt_2=None, max_sequence_length=512)
        assert embeds.shape == (512, 32) and text_ids.shape == (512, 3) and not text_ids.any()
        # batched over both prompts here, one at a time in the pipeline: float32 noise only
        torch.testing.assert_close(embeds, want_embeds[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pooled, want_pooled[0], rtol=1e-4, atol=1e-4)
    # the long prompt's tail reaches T5 only: a change after CLIP's 77 tokens moves T5 embeddings, not pooled
    changed = adapter.encode_prompts([LONG_PROMPT[:-6] + "window!"])[0]
    torch.testing.assert_close(changed[1], ours[1][1])
    assert not torch.allclose(changed[0], ours[1][0])


def test_latents_ids_and_schedules_follow_the_pipeline(flux_dev):
    from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift, retrieve_timesteps

    from stepserve.pipelines.flux import FluxAdapter

    adapter = FluxAdapter.from_pretrained(flux_dev)
    pipe, config = _pipe(flux_dev)
    mus = []
    for height, width in SIZES:
        params = SamplingParams(prompt="a", seed=3, num_inference_steps=5, guidance_scale=2.0, sampler="flow_euler",
                                height=height, width=width)
        want, want_ids = pipe.prepare_latents(1, 16, height, width, torch.float32, "cpu",
                                              torch.Generator("cpu").manual_seed(3))
        got = adapter.initial_latents(params, torch.Generator("cpu").manual_seed(3))
        assert torch.equal(got, want)
        cond = adapter.encode([params])[0]
        assert torch.equal(cond.cond["img_ids"][0], want_ids) and cond.uncond is None
        assert cond.cond["guidance"].tolist() == [2.0]
        unpacked = adapter.unpack_latents(got, (height, width))
        assert torch.equal(unpacked, FluxPipeline._unpack_latents(want, height, width, 2))
        # FluxPipeline's timesteps: sigmas linspace(1, 1/n, n) shifted by mu from the image token count
        mu = calculate_shift(want.shape[1], config["base_image_seq_len"], config["max_image_seq_len"],
                             config["base_shift"], config["max_shift"])
        scheduler = _scheduler("flow_euler", config)
        timesteps, _ = retrieve_timesteps(scheduler, 5, "cpu", sigmas=np.linspace(1.0, 1 / 5, 5), mu=mu)
        schedule = adapter.schedule(params)
        assert schedule.timesteps == tuple(timesteps.tolist())
        assert schedule.sigmas == tuple(scheduler.sigmas.tolist())
        mus.append(schedule.mu)
    assert mus[0] != mus[1]  # two sizes, two schedules


def test_previews_unpack_the_packed_latents(flux_dev):
    """A preview decodes the packed x0 estimate at the request's own (non-square) size, and is much closer to the
    final image than a decode of the raw noisy latents."""
    from stepserve.engine.core import EngineCore
    from stepserve.scheduling import make_policy

    engine = _engine(flux_dev, "continuous")
    executor = engine.executor
    p = SamplingParams(prompt="seven", seed=3, num_inference_steps=4, guidance_scale=3.5, sampler="flow_euler",
                       height=48, width=32)
    core = EngineCore(executor, make_policy("continuous", 2))
    r = core.add_request(p, 0.0, preview_steps=frozenset({2}))
    t = 0.0
    while not r.is_finished:
        core.step(t)
        t += 1
        if r.step == 2 and not r.is_finished:
            noisy = as_array(executor.pipeline.decode(r.latents, r.bucket)[0])
            preview = as_array(executor.preview(r))
    final = as_array(r.image)
    assert preview.shape == final.shape == (48, 32, 3)
    assert np.abs(final - reference_image(flux_dev, p)).max() <= 1
    assert np.abs(preview - final).mean() < 0.5 * np.abs(noisy - final).mean()


def test_folder_max_sequence_length(flux_schnell, tmp_path):
    """stepserve.json's max_sequence_length is FluxPipeline's argument of that name (T5 length), bounded by 512."""
    import json
    import shutil

    folder = tmp_path / "schnell_256"
    shutil.copytree(flux_schnell, folder)
    serving = json.loads((folder / "stepserve.json").read_text())
    (folder / "stepserve.json").write_text(json.dumps({**serving, "max_sequence_length": 256}))
    engine = Engine.from_pretrained(str(folder), max_batch_size=2, memory_cap=False)
    p = SamplingParams(prompt=LONG_PROMPT, seed=9, num_inference_steps=2, height=32, width=32)
    image = as_array(engine.generate([p])[0].image)
    pipe, config = _pipe(flux_schnell)
    pipe.scheduler = _scheduler("flow_euler", config)
    want = pipe(p.prompt, height=32, width=32, num_inference_steps=2, max_sequence_length=256,
                generator=torch.Generator("cpu").manual_seed(9), output_type="np").images[0]
    assert np.abs(image - (want * 255).round().astype(np.int16)).max() <= 1
    assert engine.executor.pipeline.encode_prompts(["a"])[0][0].shape[0] == 256
    (folder / "stepserve.json").write_text(json.dumps({**serving, "max_sequence_length": 600}))
    with pytest.raises(ValueError, match="max_sequence_length must be in 1..512"):
        Engine.from_pretrained(str(folder))


def test_deterministic_mode_is_byte_identical_in_any_company(flux_dev):
    """--deterministic pads every network call to a fixed batch size (the shared image/text ids are not rows), so
    batch company cannot change a single byte."""
    engine = Engine.from_pretrained(str(flux_dev), max_batch_size=2, memory_cap=False, deterministic=True)
    target = SamplingParams(prompt="seven", seed=5, num_inference_steps=3, guidance_scale=5.0, sampler="dpmpp_2m",
                            height=48, width=32)
    alone = engine.generate([target])[0]
    crowd = [p for p in dev_requests(6) if (p.height, p.width) == (48, 32)]
    amid = engine.generate(crowd[:1] + [target] + crowd[1:3])[1]
    assert max(amid.timing.batch_sizes) > 1
    assert np.array_equal(as_array(alone.image), as_array(amid.image))
    assert np.abs(as_array(alone.image) - reference_image(flux_dev, target)).max() <= 1


def test_http_serves_flux(flux_dev):
    """Through the OpenAI-shaped HTTP API: a Flux image equals FluxPipeline's; a negative prompt is a 400 naming it."""
    import base64
    import io

    from fastapi.testclient import TestClient
    from PIL import Image

    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.server.app import create_app

    _engine(flux_dev, "continuous")  # loads the shared executor
    app = create_app(AsyncEngine(_EXECUTORS[str(flux_dev)], strategy="continuous", max_batch_size=2))
    body = {"prompt": "a red fox", "size": "32x48", "seed": 4, "num_inference_steps": 3, "guidance_scale": 2.5,
            "sampler": "dpmpp_2m"}
    with TestClient(app) as http:
        ok = http.post("/v1/images/generations", json=body)
        refused = http.post("/v1/images/generations", json={**body, "negative_prompt": "blurry"})
    assert ok.status_code == 200, ok.text
    image = Image.open(io.BytesIO(base64.b64decode(ok.json()["data"][0]["b64_json"])))
    want = reference_image(flux_dev, SamplingParams(prompt="a red fox", seed=4, num_inference_steps=3,
                                                    guidance_scale=2.5, sampler="dpmpp_2m", height=48, width=32))
    assert np.abs(as_array(image) - want).max() <= 1
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "negative_prompt"
    assert "no negative prompt" in refused.json()["error"]["message"]
