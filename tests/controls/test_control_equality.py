"""ControlNets per request: a request alone equals diffusers' StableDiffusionControlNetPipeline with the same
ControlNet(s), scales and windows (uint8 within 1), and in mixed batches (different ControlNets, two, none,
different windows, guidance on and off, a LoRA row), under every strategy, each image is the one it gets alone."""

import numpy as np
import pytest
from control_reference import build_controlnets, diffusers_controlnet, request
from edit_images import pixels

from stepserve import Engine
from strategy_params import EVERY_STRATEGY

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    return build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))


@pytest.fixture(scope="module")
def engine(tiny_sd_path, folder):
    return Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                  controlnet_dir=str(folder))


CASES = [
    (("pose", 1.0, 0.0, 1.0),),
    (("depth", 0.9, 0.1, 0.9),),
    (("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.3, 1.0)),
    (("edge", 0.5, 0.0, 1.0), ("pose", 1.0, 0.5, 1.0)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_alone_equals_diffusers_controlnet_pipeline(engine, tiny_sd_path, folder, case, guidance):
    p = request(case, CASES[case], guidance=guidance)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_controlnet(tiny_sd_path, folder, p)).max() <= 1
    plain = engine.generate([request(case, (), guidance=guidance)])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 4  # the control did change the image


def mixed(lora: bool = False):
    controls = [(), (("pose", 1.0, 0.0, 1.0),), (("depth", 0.6, 0.3, 1.0),),
                (("pose", 0.8, 0.0, 0.5), ("depth", 1.2, 0.25, 1.0)), (("edge", 1.0, 0.5, 1.0), ("pose", 0.5, 0, 1)),
                (("depth", 1.0, 0.0, 0.4), ("pose", 0.9, 0.0, 1.0))]
    out = [request(20 + i, controls[i % 6], guidance=[4.0, 1.0, 6.0][i % 3], steps=[6, 8][i % 2])
           for i in range(8)]
    if lora:
        out[1].loras = [{"name": "a", "scale": 1.0}]
        out[3].loras = [{"name": "a", "scale": 0.5}]
    return out


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image(tiny_sd_path, folder, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=6, max_queue_delay_ms=1,
                                    controlnet_dir=str(folder))
    reqs = mixed()
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert all(r.ok for r in together), [r.error for r in together]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_a_lora_row_and_control_rows_share_the_forward(tiny_sd_path, folder, tmp_path):
    from extras import require
    from stepserve.tiny.lora import build_tiny_lora

    require("peft", "lora")
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                    controlnet_dir=str(folder))
    engine.executor.adapters().load("a", build_tiny_lora(tiny_sd_path, tmp_path / "a.safetensors", seed=1, std=0.4))
    reqs = mixed(lora=True)
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
