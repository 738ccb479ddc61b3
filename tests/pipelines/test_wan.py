"""Wan 2.1 / 2.2 text to video: served videos equal diffusers' own WanPipeline run per request alone with the same
seed, frame by frame, under every strategy and any batch company (guidance on and off, negative prompts, two
samplers, several step counts, buckets that differ in frames and in size, one-frame requests: images); Wan 2.2's two
experts split a step's rows by timestep as the pipeline switches; batch invariance and the deterministic mode's byte
identity; validation says what a request may set."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.scheduling import STRATEGIES
from wan_reference import reference_video, wan_pipe

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

PROMPTS = ["a red fox", "seven", "zz top at dawn over a long quiet lake", "blue sky", "a lighthouse"]
BUCKETS = [(5, 32, 32), (1, 32, 32), (5, 48, 32)]  # (frames, height, width): a video, an image, a taller video


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan") / "pipe")


@pytest.fixture(scope="module")
def wan22(tmp_path_factory):
    from stepserve.tiny.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("wan22") / "pipe", seed=1, wan22=True)


def _pipe(path):
    return wan_pipe(path)


def as_video(result) -> np.ndarray:
    return np.stack([np.asarray(f.convert("RGB"), dtype=np.int16) for f in result.frames])


def requests(n=12):
    return [SamplingParams(
        prompt=PROMPTS[i % len(PROMPTS)] + f" {i}",
        negative_prompt="blurry, low quality" if i % 4 == 0 else "",
        seed=700 + 13 * i,
        num_inference_steps=[2, 4, 3, 5][i % 4],
        guidance_scale=[4.0, 1.0, 2.5][i % 3],  # 1.0: no unconditional row
        sampler=("dpmpp_2m", "flow_euler")[(i // 2) % 2],
        num_frames=BUCKETS[i % 3][0], height=BUCKETS[i % 3][1], width=BUCKETS[i % 3][2],
    ) for i in range(n)]


@pytest.fixture(scope="module")
def references(wan):
    return [reference_video(wan, p) for p in requests()]


_EXECUTORS: dict = {}


def _engine(path, strategy):
    from stepserve.engine.loading import load_executor

    if str(path) not in _EXECUTORS:
        _EXECUTORS[str(path)] = load_executor(str(path))
    return Engine(_EXECUTORS[str(path)], strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)


def _check(results, params, references, strategy):
    assert all(r.ok for r in results), [r.error for r in results]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in results) > 1, "the requests never shared a batch"
    for r, p, ref in zip(results, params, references):
        got = as_video(r)
        assert got.shape == (p.num_frames, p.height, p.width, 3) == ref.shape
        assert r.image is r.frames[0]
        for k, (frame, want) in enumerate(zip(got, ref)):
            diff = np.abs(frame - want)
            assert diff.max() <= 1, (p, k, diff.max())


def test_the_references_tell_requests_apart(wan, references):
    """The equality below means something: a negative prompt, the seed and time all change the video."""
    p = requests()[0]
    assert p.negative_prompt and p.guidance_scale > 1 and p.num_frames == 5
    plain = reference_video(wan, SamplingParams(**{**vars(p), "negative_prompt": ""}))
    assert np.abs(plain - references[0]).max() > 4
    assert np.abs(references[0][0] - references[0][-1]).max() > 4  # frames differ over time
    other = reference_video(wan, SamplingParams(**{**vars(p), "seed": p.seed + 1}))
    assert np.abs(other - references[0]).max() > 4


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_wan_pipeline_video(wan, references, strategy):
    params = requests()
    _check(_engine(wan, strategy).generate(params), params, references, strategy)


@pytest.mark.parametrize("strategy", ["continuous", "dynamic"])
def test_wan22_experts_follow_the_pipeline(wan22, strategy):
    """Rows at different timesteps in one step: each on the expert the pipeline would use at its timestep."""
    params = requests(8)
    _check(_engine(wan22, strategy).generate(params), params, [reference_video(wan22, p) for p in params], strategy)
    networks = _EXECUTORS[str(wan22)].pipeline.networks
    assert networks.transformer_2 is not None and networks.boundary == 875.0


@pytest.mark.parametrize("strategy", ["continuous", "slo", "dynamic"])
def test_batch_invariance(wan, strategy):
    engine = _engine(wan, strategy)
    target = SamplingParams(prompt="seven", negative_prompt="dark", seed=5, num_inference_steps=4,
                            guidance_scale=4.0, sampler="dpmpp_2m", num_frames=5, height=48, width=32)
    alone = engine.generate([target])[0]
    crowd = requests(9)
    amid = engine.generate(crowd[:3] + [target] + crowd[3:])[3]
    assert max(amid.timing.batch_sizes) > 1
    diff = np.abs(as_video(alone) - as_video(amid))
    assert diff.max() <= 1 and diff.mean() < 0.01


@pytest.mark.parametrize("which", ["wan", "wan22"])
def test_deterministic_mode_is_byte_identical_in_any_company(which, request):
    path = request.getfixturevalue(which)
    engine = Engine.from_pretrained(str(path), max_batch_size=2, memory_cap=False, deterministic=True)
    target = SamplingParams(prompt="seven", seed=5, num_inference_steps=3, guidance_scale=3.0,
                            sampler="flow_euler", num_frames=5, height=48, width=32)
    alone = engine.generate([target])[0]
    crowd = [p for p in requests(12) if (p.num_frames, p.height, p.width) == (5, 48, 32)]
    amid = engine.generate(crowd[:1] + [target] + crowd[1:3])[1]
    assert max(amid.timing.batch_sizes) > 1
    assert np.array_equal(as_video(alone), as_video(amid))
    assert np.abs(as_video(alone) - reference_video(path, target)).max() <= 1


def test_model_info_and_validation(wan, tiny_sd_path):
    from stepserve.pipelines.wan import WanAdapter

    engine = Engine.from_pretrained(str(wan), max_batch_size=2, memory_cap=False)
    assert isinstance(engine.executor.pipeline, WanAdapter)
    info = engine.model_info
    assert (info.family, info.guidance, info.negative_prompt, info.video) == ("wan", "cfg", True, True)
    assert (info.max_frames, info.frame_step, info.default_frames, info.default_fps) == (9, 4, 5, 16)
    assert info.size_multiple == 16 and info.samplers == ("dpmpp_2m", "flow_euler")
    assert info.default_sampler == "dpmpp_2m" and info.default_guidance_scale == 5.0
    one = engine.generate([SamplingParams(prompt="a", num_inference_steps=2)])[0]  # no num_frames: one frame
    assert one.params.num_frames == 1 and len(one.frames) == 1 and one.image.size == (32, 32)
    for frames in (4, 13, 0):
        with pytest.raises(ValidationError, match=r"num_frames: must be 1 \+ a multiple of 4 from 1 to 9"):
            engine.generate([SamplingParams(prompt="a", num_frames=frames)])
    with pytest.raises(ValidationError, match="sampler: 'unipc' is not supported; allowed: dpmpp_2m, flow_euler"):
        engine.generate([SamplingParams(prompt="a", sampler="unipc")])
    with pytest.raises(ValidationError, match="height.*multiples of 16"):
        engine.generate([SamplingParams(prompt="a", height=40)])
    image_model = Engine.from_pretrained(str(tiny_sd_path), max_batch_size=2, memory_cap=False)
    with pytest.raises(ValidationError, match="num_frames: .* makes images, not videos; allowed: 1 or unset"):
        image_model.generate([SamplingParams(prompt="a", num_frames=5)])


def test_encoding_latents_and_preview_follow_the_pipeline(wan):
    from stepserve.pipelines.wan import WanAdapter

    adapter = WanAdapter.from_pretrained(wan)
    pipe, _ = _pipe(wan)
    for prompt, embeds in zip(["a  &amp; b", PROMPTS[2]], adapter.encode_prompts(["a  &amp; b", PROMPTS[2]])):
        with torch.no_grad():  # as the pipeline's __call__
            want, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=512,
                                         device="cpu")
        assert embeds.shape == (512, 32) and torch.equal(embeds, want[0])
    for frames, height, width in BUCKETS:
        params = SamplingParams(prompt="a", seed=3, num_frames=frames, height=height, width=width)
        want = pipe.prepare_latents(1, 4, height, width, frames, torch.float32, "cpu",
                                    torch.Generator("cpu").manual_seed(3))
        assert torch.equal(adapter.initial_latents(params, torch.Generator("cpu").manual_seed(3)), want)
    latents = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator("cpu").manual_seed(0))
    first = np.asarray(adapter.preview(latents, (5, 32, 32)), dtype=np.int16)
    whole = np.asarray(adapter.decode(latents, (5, 32, 32))[0][0], dtype=np.int16)
    assert np.abs(first - whole).max() <= 1  # the causal VAE's first frame, decoded alone
