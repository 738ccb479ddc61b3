"""--cfg-parallel keeps every feature a family serves: LoRA rows, step-cached rows (fbcache, deepcache), ControlNet
rows (guess mode too), IP-Adapter rows, image-to-image and inpainting rows, sent together with plain rows (guided and not), each
equal to itself served by one process (uint8 within 1), for tiny SD 1.x, SDXL and SD3 (where capabilities.py says
the family serves the feature)."""

import numpy as np
import pytest
import torch
from control_reference import build_controlnets
from edit_images import mask_image, pixels, start_image
from extras import require
from ip_adapter_reference import build_ip_adapters

from stepserve import Engine, SamplingParams
from stepserve.capabilities import FAMILIES
from stepserve.parallel.degrees import Degrees
from stepserve.tiny.lora import build_tiny_lora

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

SIZES = {"sd": (16, 24), "sdxl": (16, 24), "sd3": (32, 24)}  # each family's two heights (width: the first)
SAMPLER = {"sd": "dpmpp_2m", "sdxl": "euler", "sd3": "flow_euler"}


def feature_requests(family: str) -> list[SamplingParams]:
    """One request per feature the family serves, beside plain ones; sizes and guidance (<= 1 too) mixed."""
    c, (h, h2) = FAMILIES[family], SIZES[family]

    def req(i, guidance=4.0, height=h, steps=4, **extra):
        return SamplingParams(prompt=f"a small cat {i}", seed=900 + i, num_inference_steps=steps,
                              guidance_scale=guidance, sampler=SAMPLER[family], height=height, width=h, **extra)

    out = [req(0, guidance=5.0), req(1, guidance=1.0, height=h2, steps=3),
           req(2, loras=[{"name": "a", "scale": 1.0}]),
           req(3, guidance=1.0, loras=[{"name": "a", "scale": 0.5}]),
           req(4, height=h2, controls=[{"name": "pose", "image": start_image(4, size=h), "scale": 0.8}]),
           req(5, image=start_image(5, size=h), strength=0.7, steps=5)]
    # fbcache at a threshold that reuses steps on the tiny random model (decided per row, on each rank's own rows)
    out += [req(6 + i, cache={"policy": policy, "threshold": 2.0} if policy == "fbcache" else policy, steps=6)
            for i, policy in enumerate(c.caches)]
    if c.guess_mode:  # its unconditional row runs no ControlNet: the unconditional half may have none to run
        out.append(req(10, controls=[{"name": "depth", "image": start_image(10, size=h), "guess_mode": True}]))
    if c.ip_adapter:
        out.append(req(8, ip_adapter={"name": "face", "image": start_image(8, size=24), "scale": 1.0}))
    if c.inpaint:
        out.append(req(9, image=start_image(9, size=h), mask_image=mask_image(9, size=h), strength=0.8, steps=5))
    return out


def model_path(family, tiny_sd_path, tmp_path_factory):
    if family == "sd":
        return tiny_sd_path
    module = __import__(f"stepserve.tiny.{family}", fromlist=["x"])
    return getattr(module, f"build_tiny_{family}")(tmp_path_factory.mktemp(family) / "pipe")


@pytest.fixture(scope="module", params=["sd", pytest.param("sdxl", marks=pytest.mark.slow),
                                        pytest.param("sd3", marks=pytest.mark.slow)])
def engines(request, tiny_sd_path, tmp_path_factory):
    """(family, one process's engine, the --cfg-parallel engine): the same add-on folders; closed at the end."""
    require("peft", "lora")
    family = request.param
    path = model_path(family, tiny_sd_path, tmp_path_factory)
    loras = tmp_path_factory.mktemp("loras")
    build_tiny_lora(path, loras / "a.safetensors", seed=1, std=0.3)
    folders = {"lora_dir": str(loras),
               "controlnet_dir": str(build_controlnets(path, tmp_path_factory.mktemp("controlnets")))}
    if FAMILIES[family].ip_adapter:
        folders["ip_adapter_dir"] = str(build_ip_adapters(path, tmp_path_factory.mktemp("ip_adapters"), std=0.2))
    threads = torch.get_num_threads()
    options = dict(threads=1, memory_cap=False, strategy="continuous", max_batch_size=8, max_queue_delay_ms=1,
                   **folders)
    single = Engine.from_pretrained(str(path), **options)
    split = Engine.from_pretrained(str(path), degrees=Degrees(cfg=True), **options)
    try:
        yield family, single, split
    finally:
        split.executor.close()
        torch.set_num_threads(threads)  # the suite's (conftest): threads=1 set this process's


@pytest.mark.parametrize("strategy", ["continuous", pytest.param("slo", marks=pytest.mark.slow)])
def test_each_feature_row_equals_one_process(engines, strategy):
    family, single, split = engines
    if strategy != "continuous":
        split = Engine(split.executor, strategy=strategy, max_batch_size=8, max_queue_delay_ms=1)
    params = feature_requests(family)
    want = single.generate(params)
    got = split.generate(params)
    assert all(r.ok for r in want + got), [r.error for r in want + got]
    assert max(max(r.timing.batch_sizes) for r in got) > 1, "the requests never shared a batch"
    for p, a, b in zip(params, want, got):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1, (family, p)
        assert a.timing.cached_steps == b.timing.cached_steps, (family, p)  # the same steps reused
    assert all(b.timing.cached_steps for p, b in zip(params, got) if p.cache), "no cached row reused a step"


def test_each_half_runs_the_controlnets_on_its_own_rows(engines, monkeypatch):
    """Rank 0 (the conditional half) runs each ControlNet on its conditional rows only, not on the whole step's."""
    family, single, split = engines
    pipeline = split.executor.pipeline
    seen: list[int] = []
    forward = pipeline.control_forward
    monkeypatch.setattr(pipeline, "control_forward",
                        lambda net, sample, *a: (seen.append(sample.shape[0]), forward(net, sample, *a))[1])
    h = SIZES[family][0]
    params = [SamplingParams(prompt=f"a cat {i}", seed=i, num_inference_steps=3, guidance_scale=[4.0, 6.0, 1.0][i],
                             sampler=SAMPLER[family], height=h, width=h,
                             controls=[{"name": "pose", "image": start_image(i, size=h)}]) for i in range(3)]
    want, got = single.generate(params), split.generate(params)
    assert max(max(r.timing.batch_sizes) for r in got) == 3
    assert seen and max(seen) == 3  # 3 conditional rows of 5 (2 requests are guided)
    for p, a, b in zip(params, want, got):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1, (family, p)
