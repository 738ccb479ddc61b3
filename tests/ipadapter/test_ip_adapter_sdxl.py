"""IP-Adapter per request on SDXL: a request alone equals diffusers' StableDiffusionXLPipeline with load_ip_adapter
and set_ip_adapter_scale (uint8 within 1, guidance on and off; the UNet's added conditions keep SDXL's text and time
embeddings beside the image embeddings); a plain request on an engine with the adapter loaded is the plain
pipeline; in mixed batches (image prompts at different scales, plain rows, ControlNet rows, LoRA rows), under every
strategy, each image is the one it gets alone."""

import numpy as np
import pytest
from control_reference import build_controlnets
from edit_images import pixels, start_image
from ip_adapter_reference import build_ip_adapters, diffusers_ip_adapter, request

from stepserve import Engine
from strategy_params import EVERY_STRATEGY

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    """(the tiny SDXL folder, its IP-Adapter folder, its ControlNet folder, a LoRA file of it)."""
    from stepserve.tiny.lora import build_tiny_lora
    from stepserve.tiny.sdxl import build_tiny_sdxl

    root = tmp_path_factory.mktemp("ip_adapter_sdxl")
    pipe = build_tiny_sdxl(root / "pipe")
    return (pipe, build_ip_adapters(pipe, root / "ip_adapters", std=0.2), build_controlnets(pipe, root / "controlnets"),
            build_tiny_lora(pipe, root / "a.safetensors", seed=1, std=0.3))


def sdxl_engine(sdxl, **options):
    pipe, folder, controlnets, lora = sdxl
    engine = Engine.from_pretrained(str(pipe), ip_adapter_dir=str(folder), controlnet_dir=str(controlnets),
                                    **{"strategy": "continuous", "max_batch_size": 8, **options})
    engine.executor.adapters().load("a", lora)
    return engine


@pytest.fixture(scope="module")
def engine(sdxl):
    return sdxl_engine(sdxl)


@pytest.mark.parametrize("scale, guidance", [(1.0, 5.0), (0.6, 1.0)])
def test_alone_equals_diffusers_sdxl_ip_adapter_pipeline(engine, sdxl, scale, guidance):
    p = request(1, "face", scale, guidance=guidance)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_ip_adapter(sdxl[0], sdxl[1], p, "sdxl")).max() <= 1
    plain = engine.generate([request(1, None, guidance=guidance)])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 4  # the image prompt did change the image


def test_a_plain_request_on_an_engine_with_the_adapter_loaded_is_the_plain_pipeline(engine, sdxl):
    engine.generate([request(2, "style", 1.0)])
    assert "style" in engine.executor.ip_adapters().loaded
    for guidance in (5.0, 1.0):
        p = request(3, None, guidance=guidance)
        got = engine.generate([p])[0]
        assert np.abs(pixels(got.image) - diffusers_ip_adapter(sdxl[0], sdxl[1], p, "sdxl")).max() == 0


def mixed():
    out = [request(20 + i, [None, "face"][i % 2 if i < 5 else 1], [1.0, 0.4, 1.3][i % 3],
                   guidance=[5.0, 1.0, 6.0][i % 3], steps=[4, 5][(i // 2) % 2]) for i in range(6)]
    out[2].controls = [{"name": "pose", "image": start_image(90), "scale": 0.8}]
    out[3].controls = [{"name": "depth", "image": start_image(91)}]
    out[0].loras = [{"name": "a", "scale": 1.0}]
    out[5].loras = [{"name": "a", "scale": 0.5}]
    return out


@pytest.fixture(scope="module")
def alone(engine):
    got = [engine.generate([p])[0] for p in mixed()]
    assert all(r.ok for r in got), [r.error for r in got]
    return got


def test_the_mix_has_each_kind_of_row():
    kinds = [(p.ip_adapter is not None, bool(p.controls), bool(p.loras)) for p in mixed()]
    assert {k[0] for k in kinds} == {True, False} and any(k[0] and k[1] for k in kinds)
    assert any(k[0] and k[2] for k in kinds) and any(not k[0] and k[2] for k in kinds)
    assert len({p.ip_adapter["scale"] for p in mixed() if p.ip_adapter is not None}) > 1


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image(sdxl, alone, strategy):
    engine = sdxl_engine(sdxl, strategy=strategy, max_batch_size=6, max_queue_delay_ms=1)
    together = engine.generate(mixed())
    assert all(r.ok for r in together), [r.error for r in together]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_cached_rows_and_image_prompt_rows_share_a_forward(engine, sdxl):
    """Rows that cache steps run the UNet part by part (stepserve/caching): the image embeddings reach it beside
    SDXL's added text and time embeddings there too; requests with image prompts (one adapter or two) or with a
    ControlNet cache as well, and each gets its own image and skips beside the others."""
    deep = {"policy": "deepcache", "interval": 2}
    both = request(34, None, cache=deep)
    both.ip_adapter = [{"name": "face", "image": start_image(60), "scale": 0.8},
                       {"name": "style", "image": start_image(61, size=40), "scale": 1.1}]
    controlled = request(35, None, cache={"policy": "deepcache", "interval": 2}, guidance=1.0)  # the shallow ControlNet
    controlled.controls = [{"name": "pose", "image": start_image(92), "scale": 0.8}]
    reqs = [request(30, None, cache=deep), request(31, "face", 1.0, cache=deep),
            request(32, None, cache={"policy": "fbcache", "threshold": 0.5}, guidance=1.0),
            request(33, "face", 0.7, guidance=1.0), both, controlled]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(together[0].timing.batch_sizes) == 6 and together[0].timing.cached_steps > 0
    assert together[1].timing.cached_steps > 0 and together[4].timing.cached_steps > 0
    for a, b in zip(alone, together):
        assert b.ok, b.error
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_the_shallow_controlnet_forward_on_sdxl_gives_the_whole_forwards_first_outputs(engine):
    """With SDXL's added text and time embeddings (caching with controls: pipelines/control_inputs.py)."""
    import torch

    pipeline = engine.executor.pipeline
    net = engine.executor.controlnets().ensure(["pose"])["pose"]
    c = pipeline.unet.config
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, c.in_channels, 8, 8, generator=g)
    text_width = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
    conditioning = {"encoder_hidden_states": torch.randn(2, 5, c.cross_attention_dim, generator=g),
                    "text_embeds": torch.randn(2, text_width, generator=g),
                    "time_ids": torch.tensor([[16.0, 16, 0, 0, 16, 16]] * 2)}
    images, t = torch.rand(2, 3, 16, 16, generator=g), torch.tensor([700.0, 100.0])
    with torch.inference_mode():  # as the engine runs every forward (its weights may be inference tensors)
        whole = pipeline.control_forward(net, x, t, conditioning, images)["down_block_additional_residuals"]
        part = pipeline.control_forward_shallow(net, x, t, conditioning, images)["down_block_additional_residuals"]
    assert len(part) == len(pipeline.unet.up_blocks[-1].resnets)
    assert all(torch.equal(a, b) for a, b in zip(part, whole))
