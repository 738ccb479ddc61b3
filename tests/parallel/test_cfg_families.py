"""--cfg-parallel on the CPU (2 gloo ranks, one thread each): tiny SD 1.x, SDXL and SD3 serve requests of mixed
sizes, steps and guidance (some at guidance <= 1: no unconditional row, so a step's halves differ in rows) sent
together, and each image equals diffusers' own pipeline run alone (uint8 within 1), under continuous and slo."""

import numpy as np
import pytest
import torch
from served_equal import assert_served_equal
from tiny_sd import SCHEDULER_CLASS

from stepserve import Engine, SamplingParams
from stepserve.parallel.degrees import Degrees

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

# per family: (the two sizes (height, width), its samplers, diffusers' pipeline class)
FAMILIES = {"sd": (((16, 16), (24, 16)), ("dpmpp_2m", "euler_a", "ddim"), "StableDiffusionPipeline"),
            "sdxl": (((16, 16), (24, 16)), ("euler", "dpmpp_2m"), "StableDiffusionXLPipeline"),
            "sd3": (((32, 32), (24, 40)), ("flow_euler",), "StableDiffusion3Pipeline")}


def mixed_requests(family: str, n: int = 6) -> list[SamplingParams]:
    sizes, samplers, _ = FAMILIES[family]
    return [SamplingParams(prompt=["a red fox", "seven", "blue sky"][i % 3] + f" {i}",
                           negative_prompt=["", "blurry"][i % 2], seed=40 + 7 * i,
                           num_inference_steps=[3, 5, 4][i % 3], guidance_scale=[4.5, 1.0, 7.0, 0.5][i % 4],
                           sampler=samplers[i % len(samplers)], height=sizes[i % 2][0], width=sizes[i % 2][1])
            for i in range(n)]


def reference_image(family: str, path, p: SamplingParams) -> np.ndarray:
    """diffusers' own pipeline for this one request, alone, with the same seed."""
    import diffusers

    pipe = getattr(diffusers, FAMILIES[family][2]).from_pretrained(
        path, **({"add_watermarker": False} if family == "sdxl" else {"safety_checker": None} if family == "sd"
                 else {}))
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = getattr(diffusers, SCHEDULER_CLASS[p.sampler]).from_config(pipe.scheduler.config)
    image = pipe(p.prompt, negative_prompt=p.negative_prompt or None, height=p.height, width=p.width,
                 num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                 generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def model_path(family, tiny_sd_path, tmp_path_factory):
    if family == "sd":
        return tiny_sd_path
    if family == "sdxl":
        from stepserve.tiny.sdxl import build_tiny_sdxl

        return build_tiny_sdxl(tmp_path_factory.mktemp("sdxl") / "pipe")
    from stepserve.tiny.sd3 import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("sd3") / "pipe")


@pytest.fixture(scope="module", params=["sd", pytest.param("sdxl", marks=pytest.mark.slow),
                                        pytest.param("sd3", marks=pytest.mark.slow)])
def served(request, tiny_sd_path, tmp_path_factory):
    """(family, its path, its parallel engine: loaded once, closed at the end)."""
    family = request.param
    path = model_path(family, tiny_sd_path, tmp_path_factory)
    threads = torch.get_num_threads()
    engine = Engine.from_pretrained(str(path), degrees=Degrees(cfg=True), threads=1, memory_cap=False,
                                    strategy="continuous", max_batch_size=4, max_queue_delay_ms=1)
    try:
        yield family, path, engine
    finally:
        engine.executor.close()
        torch.set_num_threads(threads)  # the suite's (conftest): threads=1 set this process's


@pytest.mark.parametrize("strategy", ["continuous", pytest.param("slo", marks=pytest.mark.slow)])
def test_cfg_parallel_gives_diffusers_image(served, strategy):
    family, path, engine = served
    if strategy != "continuous":  # the same loaded ranks under another policy
        engine = Engine(engine.executor, strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    params = mixed_requests(family)
    results = engine.generate(params)
    assert_served_equal(results, params, [reference_image(family, path, p) for p in params], strategy, family)
