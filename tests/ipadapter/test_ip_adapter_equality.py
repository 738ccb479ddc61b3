"""IP-Adapter per request: a request alone equals diffusers' StableDiffusionPipeline with load_ip_adapter and
set_ip_adapter_scale (uint8 within 1, guidance on and off); a request without an image prompt on an engine with the
adapter loaded equals the plain pipeline; in mixed batches (image prompts at different scales, plain rows, a
ControlNet row, a LoRA row), under every strategy, each image is the one it gets alone."""

import numpy as np
import pytest
from control_reference import build_controlnets
from edit_images import pixels, start_image
from ip_adapter_reference import build_ip_adapters, diffusers_ip_adapter, request

from stepserve import Engine
from strategy_params import EVERY_STRATEGY

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    return build_ip_adapters(tiny_sd_path, tmp_path_factory.mktemp("ip_adapters"), std=0.2)


@pytest.fixture(scope="module")
def controlnets(tiny_sd_path, tmp_path_factory):
    return build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))


@pytest.fixture(scope="module")
def engine(tiny_sd_path, folder):
    return Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                  ip_adapter_dir=str(folder))


@pytest.mark.parametrize("scale", [1.0, 0.6])
@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_alone_equals_diffusers_ip_adapter_pipeline(engine, tiny_sd_path, folder, scale, guidance):
    p = request(1, "face", scale, guidance=guidance)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_ip_adapter(tiny_sd_path, folder, p)).max() <= 1
    plain = engine.generate([request(1, None, guidance=guidance)])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 4  # the image prompt did change the image


def test_a_plain_request_on_an_engine_with_the_adapter_loaded_is_the_plain_pipeline(engine, tiny_sd_path, folder):
    engine.generate([request(2, "face", 1.0)])
    assert "face" in engine.executor.ip_adapters().loaded
    for guidance in (4.0, 1.0):
        p = request(3, None, guidance=guidance)
        got = engine.generate([p])[0]
        assert np.abs(pixels(got.image) - diffusers_ip_adapter(tiny_sd_path, folder, p)).max() == 0


def test_plain_rows_beside_image_prompt_rows_are_exact(engine):
    """In one forward with image-prompt rows, a row without one gets exactly the plain model's output (scale 0 and
    a zero embedding: its image attention adds exact zeros)."""
    plain = [request(4, None), request(5, None, guidance=1.0)]
    alone = [engine.generate([p])[0] for p in plain]
    together = engine.generate([request(6, "face", 1.0), plain[0], request(7, "face", 0.5, guidance=1.0),
                                plain[1]])
    assert max(together[1].timing.batch_sizes) == 4
    for a, b in zip(alone, (together[1], together[3])):
        assert np.array_equal(pixels(a.image), pixels(b.image))


def mixed(control=False, lora=False):
    names = [None, "face", None, "style", None, "face", "style"]  # two adapters, rows of each in one forward
    out = [request(20 + i, names[i], [1.0, 0.4, 1.3][i % 3],
                   guidance=[4.0, 1.0, 6.0][i % 3], steps=[6, 8][(i // 2) % 2]) for i in range(7)]
    if control:
        out[2].controls = [{"name": "pose", "image": start_image(90), "scale": 0.8}]
        out[3].controls = [{"name": "depth", "image": start_image(91)}]
    if lora:
        out[0].loras = [{"name": "a", "scale": 1.0}]
        out[5].loras = [{"name": "a", "scale": 0.5}]
    return out


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image(tiny_sd_path, folder, controlnets, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=6, max_queue_delay_ms=1,
                                    ip_adapter_dir=str(folder), controlnet_dir=str(controlnets))
    reqs = mixed(control=True)
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert all(r.ok for r in together), [r.error for r in together]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_a_lora_row_a_control_row_and_image_prompt_rows_share_the_forward(tiny_sd_path, folder, controlnets,
                                                                         tmp_path):
    from extras import require
    from stepserve.tiny.lora import build_tiny_lora

    require("peft", "lora")
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                    ip_adapter_dir=str(folder), controlnet_dir=str(controlnets))
    engine.executor.adapters().load("a", build_tiny_lora(tiny_sd_path, tmp_path / "a.safetensors", seed=1, std=0.4))
    reqs = mixed(control=True, lora=True)
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) == len(reqs)
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
