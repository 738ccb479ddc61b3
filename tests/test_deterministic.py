"""--deterministic: a request's image is byte-identical alone and inside mixed batches of every size, under every
batching strategy, because every forward runs at one fixed padded shape. Checked from the kernels up: rows of a
fixed-shape forward do not depend on the other rows or on their position, the samplers' arithmetic is row-wise,
and the engine never counts padding rows as requests."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.backends.fast_path import FastPathOptions

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

MAX_BATCH = 4  # denoiser rows fixed at 8 (a conditional and an unconditional row per request), decode at 4
STRATEGIES = ("none", "static", "dynamic", "continuous")
SD_SAMPLERS = ("ddim", "euler", "euler_a", "dpmpp_2m")


@pytest.fixture(scope="module")
def embedded():
    from stepserve.pipelines.diffusers_sd import StableDiffusionAdapter

    return StableDiffusionAdapter.from_pretrained("embedded")


def _positions_check(fn, inputs: list[torch.Tensor], fixed: int, seed: int) -> int:
    """Rows of fn at the fixed batch size: put the reference rows at shuffled positions among random other rows;
    returns how many rows came out different (bitwise) from the reference run."""
    g = torch.Generator().manual_seed(seed)
    reference = fn(*inputs)
    differing = 0
    for _ in range(3):
        perm = torch.randperm(fixed, generator=g)
        keep = fixed // 2
        mixed = []
        for x in inputs:
            other = (torch.randint(0, 100, x.shape, generator=g) if x.dtype == torch.int64
                     else torch.randn(x.shape, generator=g) * x.std() + x.mean())
            other[perm[:keep]] = x[:keep]
            mixed.append(other)
        out = fn(*mixed)
        differing += sum(not torch.equal(out[perm[k]], reference[k]) for k in range(keep))
    return differing


def test_rows_of_a_fixed_shape_forward_do_not_depend_on_the_other_rows(embedded):
    nets, fixed = embedded.networks, 2 * MAX_BATCH
    g = torch.Generator().manual_seed(0)
    shape = embedded.latent_shape(32, 32)[1:]
    embeds = embedded.encode_prompts(["seven"])[0]
    sample = torch.randn(fixed, *shape, generator=g)
    t = torch.rand(fixed, generator=g) * 999
    cond = embeds.expand(fixed, *embeds.shape) + 0.1 * torch.randn(fixed, *embeds.shape, generator=g)
    assert _positions_check(lambda x, t, e: nets.denoise(x, t, encoder_hidden_states=e), [sample, t, cond],
                            fixed, 1) == 0
    assert _positions_check(nets.decode, [torch.randn(fixed, *shape, generator=g)], fixed, 2) == 0
    ids = torch.randint(0, 100, (fixed, embedded.tokenizer.model_max_length), generator=g)
    assert _positions_check(lambda i: nets.encode_text(i, None), [ids], fixed, 3) == 0


@pytest.mark.parametrize("sampler", SD_SAMPLERS)
def test_sampler_rows_alone_equal_rows_in_a_batch_bitwise(embedded, sampler):
    from stepserve import sampling

    rows = 24
    g = torch.Generator().manual_seed(4)
    latents, pred = torch.randn(rows, 4, 8, 8, generator=g), torch.randn(rows, 4, 8, 8, generator=g)
    steps = [k % 5 for k in range(rows)]

    def states():
        out = [sampling.new_state(sampling.build_schedule(sampler, embedded.scheduler_config, 10),
                                  torch.Generator().manual_seed(k)) for k in range(rows)]
        for k, st in enumerate(out):  # a multistep solver's previous prediction, the same in both runs
            if steps[k] > 0:
                st.history[steps[k] - 1] = torch.full((4, 8, 8), 0.01 * k)
        return out

    batch = sampling.sampler_step(pred, latents, states(), steps)
    alone_states = states()
    for k in range(rows):
        alone = sampling.sampler_step(pred[k:k + 1], latents[k:k + 1], [alone_states[k]], [steps[k]])
        assert torch.equal(alone[0], batch[k]), f"row {k} differs alone"


def _engine(strategy: str, **fast_path) -> Engine:
    options = FastPathOptions(deterministic=True, progress=False, **fast_path)
    return Engine.from_pretrained("embedded", strategy=strategy, max_batch_size=MAX_BATCH, memory_cap=False,
                                  fast_path=options)


@pytest.fixture(scope="module")
def engines():
    return {s: _engine(s) for s in STRATEGIES}


def _others(rng: random.Random, k: int) -> list[SamplingParams]:
    return [SamplingParams(prompt=rng.choice(["one", "two", "nine", "four"]), seed=rng.randrange(1000),
                           num_inference_steps=rng.choice([2, 4, 6]), sampler=rng.choice(SD_SAMPLERS),
                           guidance_scale=rng.choice([1.0, 3.0])) for _ in range(k)]


TARGETS = [SamplingParams(prompt="seven", seed=7, num_inference_steps=5, sampler="dpmpp_2m", guidance_scale=3.0),
           SamplingParams(prompt="three", seed=3, num_inference_steps=4, sampler="euler_a", guidance_scale=1.0)]
SIZES = (1, 2, 3, MAX_BATCH, MAX_BATCH + 2)  # every batch size, and more requests than one batch holds


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_image_is_byte_identical_alone_and_in_mixed_batches_of_every_size(engines, strategy):
    engine = engines[strategy]
    rng = random.Random(strategy)
    for target in TARGETS:
        alone = engines["none"].generate([target])[0].image.tobytes()
        for size in SIZES if strategy != "none" else (3,):  # none runs one request at a time whatever the size
            others = _others(rng, size - 1)
            at = rng.randrange(size)
            results = engine.generate(others[:at] + [target] + others[at:])
            assert all(r.ok for r in results)
            assert results[at].image.tobytes() == alone, (target.sampler, size, at)


def test_padding_rows_never_reach_metrics(engines):
    engine = engines["static"]
    wrapper = engine.executor.pipeline.networks
    wrapper.calls.clear()
    params = [SamplingParams(prompt="two", seed=s, num_inference_steps=4, guidance_scale=1.0) for s in range(3)]
    results = engine.generate(params)
    assert [r.timing.batch_sizes for r in results] == [[3] * 4] * 3  # three requests, not the 8 padded rows
    assert wrapper.calls == {2 * MAX_BATCH: 4}  # while every forward ran at the fixed size


def test_compiled_deterministic_engine_matches_eager_and_stays_byte_identical(engines):
    compiled = _engine("continuous", compile=True, compile_backend="aot_eager")
    target = TARGETS[1]
    alone = np.asarray(compiled.generate([target])[0].image)
    eager = np.asarray(engines["none"].generate([target])[0].image)
    assert np.abs(alone.astype(int) - eager.astype(int)).max() <= 1
    mixed = compiled.generate(_others(random.Random(9), 3) + [target])
    assert mixed[-1].image.tobytes() == alone.tobytes()


@pytest.mark.parametrize("family", ["sdxl", "flux"])
def test_other_families_are_byte_identical_too(tmp_path, family):
    """The wrapper pads every batched conditioning keyword (SDXL's text_embeds/time_ids, Flux's pooled projections
    and guidance) and passes Flux's shared position ids through."""
    import importlib

    build = getattr(importlib.import_module(f"stepserve.tiny.{family}"), f"build_tiny_{family}")
    engine = Engine.from_pretrained(str(build(tmp_path / family)), max_batch_size=2, memory_cap=False,
                                    fast_path=FastPathOptions(deterministic=True, progress=False))
    target = SamplingParams(prompt="a cat", seed=5, num_inference_steps=3)
    alone = engine.generate([target])[0].image.tobytes()
    rng = random.Random(family)
    for size in (2, 3):
        others = [SamplingParams(prompt=rng.choice(["dog", "tree"]), seed=rng.randrange(99),
                                 num_inference_steps=rng.choice([2, 3, 4])) for _ in range(size - 1)]
        at = rng.randrange(size)
        results = engine.generate(others[:at] + [target] + others[at:])
        assert results[at].image.tobytes() == alone, (family, size, at)
    assert set(engine.executor.pipeline.networks.calls) == {4}
