"""--deterministic with --cfg-parallel: every rank wraps its networks at the same fixed padded shape, so a request's
image is byte-identical alone and inside mixed batches (guided and not, other samplers and steps), and equal to one
process's deterministic image; with a sequence split it is refused at start-up in one line."""

import numpy as np
import pytest
import torch
from edit_images import pixels

from stepserve import Engine, SamplingParams
from stepserve.engine.config import EngineConfig
from stepserve.engine.loading import check_pairs
from stepserve.backends.fast_path import FastPathOptions
from stepserve.parallel.degrees import Degrees

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

OPTIONS = dict(deterministic=True, threads=1, memory_cap=False, strategy="continuous", max_batch_size=4,
               max_queue_delay_ms=1)


def crowd(n=6):
    return [SamplingParams(prompt=f"zz top {i}", seed=60 + i, num_inference_steps=[3, 6, 4][i % 3],
                           guidance_scale=[7.5, 1.0, 3.0][i % 3], sampler=["euler_a", "ddim", "dpmpp_2m"][i % 3],
                           height=16, width=16) for i in range(n)]


TARGETS = [SamplingParams(prompt="seven", seed=5, num_inference_steps=5, guidance_scale=5.0, sampler="euler_a",
                          height=16, width=16),
           SamplingParams(prompt="a cat", seed=6, num_inference_steps=4, guidance_scale=1.0, sampler="dpmpp_2m",
                          height=16, width=16)]


@pytest.fixture(scope="module")
def split(tiny_sd_path):
    threads = torch.get_num_threads()
    engine = Engine.from_pretrained(str(tiny_sd_path), degrees=Degrees(cfg=True), **OPTIONS)
    try:
        yield engine
    finally:
        engine.executor.close()
        torch.set_num_threads(threads)  # the suite's (conftest): threads=1 set this process's


@pytest.mark.slow  # a parallel engine at the fixed shape: about 6 s
def test_every_rank_runs_the_denoiser_at_the_fixed_shape(split):
    assert split.executor.pipeline.networks.fixed_rows == 8  # 2 x max_batch_size rows, as one process
    assert [w["fixed_rows"] for w in split.executor.workers_state()] == [8]


@pytest.mark.slow
@pytest.mark.parametrize("target", range(len(TARGETS)))
def test_byte_identical_alone_and_in_any_company(split, tiny_sd_path, target):
    p = TARGETS[target]
    alone = pixels(split.generate([p])[0].image)
    others = crowd()
    for company in (others[:1], others[:3], others):  # batches of 2, 4 and 4 + the queue: other rows, other halves
        results = split.generate(company[: len(company) // 2] + [p] + company[len(company) // 2:])
        amid = results[len(company) // 2]
        assert amid.ok and max(amid.timing.batch_sizes) > 1, amid.error
        assert np.array_equal(pixels(amid.image), alone), len(company)
    single = Engine.from_pretrained(str(tiny_sd_path), **OPTIONS)  # as one process gives it
    assert np.array_equal(pixels(single.generate([p])[0].image), alone)


def test_with_a_sequence_split_it_is_refused_in_one_line():
    config = EngineConfig(model="embedded", degrees=Degrees(ulysses=2), fast_path=FastPathOptions(deterministic=True))
    with pytest.raises(ValueError, match=r"^--ulysses-degree 2 with --deterministic is not served \(byte-identical "
                                         r"images across batch mixes are held for --cfg-parallel alone; .*\); "
                                         r"allowed: one of them$"):
        check_pairs(config)
