"""Step caching with ControlNets and image prompts on a UNet (tiny SD): a reused step is the full forward with this
step's ControlNet residuals for the shallow skips and the last full step's deep features (computed with that
step's residuals); deepcache at interval 1 and fbcache at
threshold 0 give the uncached image bit for bit (which equals diffusers' ControlNet / IP-Adapter pipeline:
tests/controls, tests/ipadapter); deepcache skips exactly the steps its interval says; in mixed batches of cached
and uncached rows with and without controls and image prompts, under every strategy, each request gets its own
image and skips the same steps as alone."""

import math

import numpy as np
import pytest
import torch
from control_reference import build_controlnets, request as controlled
from edit_images import pixels
from ip_adapter_reference import build_ip_adapters, request as prompted
from strategy_params import EVERY_STRATEGY

from stepserve import Engine
from stepserve.caching.rows import RowCache
from stepserve.caching.unet import unet_forward
from stepserve.request.types import CacheSpec

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def folders(tiny_sd_path, tmp_path_factory):
    return (build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets")),
            build_ip_adapters(tiny_sd_path, tmp_path_factory.mktemp("ip_adapters"), std=0.2))


def make_engine(path, folders, strategy="continuous"):
    return Engine.from_pretrained(str(path), strategy=strategy, max_batch_size=8, max_queue_delay_ms=1,
                                  controlnet_dir=str(folders[0]), ip_adapter_dir=str(folders[1]))


@pytest.fixture(scope="module")
def engine(tiny_sd_path, folders):
    return make_engine(tiny_sd_path, folders)


def with_cache(p, cache):
    p.cache = cache
    return p


def test_a_reused_step_takes_its_own_shallow_residuals_on_the_last_full_steps_deep_features(engine):
    unet = engine.executor.pipeline.unet
    controlnet = engine.executor.controlnets().ensure(["pose"])["pose"]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, unet.config.in_channels, 8, 8, generator=g)  # a 16x16 request's latents
    t, e = torch.tensor([900.0, 300.0]), torch.randn(2, 5, unet.config.cross_attention_dim, generator=g)
    down, mid = controlnet(x, t, encoder_hidden_states=e, controlnet_cond=torch.rand(2, 3, 16, 16, generator=g),
                           return_dict=False)
    residuals = {"down_block_additional_residuals": tuple(down), "mid_block_additional_residual": mid}
    first = [RowCache(CacheSpec("deepcache", interval=4), {}, 0) for _ in range(2)]
    want = unet(x, t, encoder_hidden_states=e, return_dict=False, **residuals)[0]
    assert torch.equal(unet_forward(unet, x, t, e, first, **residuals), want)  # step 0 computes and caches
    # Step 1 reuses step 0's deep features with step 1's own residuals (other ones) for the shallow skips: the full
    # forward with step 1's shallow residuals and step 0's deep and mid ones.
    later = [r * -0.7 + 0.05 for r in down]
    shallow = len(unet.up_blocks[-1].resnets)  # the skips the last up block takes (conv_in's, the first block's)
    hybrid = tuple(later[:shallow]) + tuple(down[shallow:])
    want = unet(x, t, encoder_hidden_states=e, down_block_additional_residuals=hybrid,
                mid_block_additional_residual=mid, return_dict=False)[0]
    again = [RowCache(CacheSpec("deepcache", interval=4), r.tensors, 1) for r in first]
    got = unet_forward(unet, x, t, e, again, down_block_additional_residuals=tuple(later),
                       mid_block_additional_residual=mid * 3)
    assert all(r.skipped for r in again)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    full = unet(x, t, encoder_hidden_states=e, down_block_additional_residuals=tuple(later),
                mid_block_additional_residual=mid * 3, return_dict=False)[0]
    assert not torch.allclose(got, full, atol=1e-4)  # the deep residuals of step 1 were not used: it was cached


@pytest.mark.parametrize("make", [
    lambda: controlled(1, [("pose", 0.9, 0.0, 1.0), ("depth", 0.6, 0.2, 0.8)], steps=8),
    lambda: prompted(2, "face", 0.8, steps=8),
])
def test_interval_one_and_threshold_zero_are_the_uncached_image(engine, make):
    plain = engine.generate([make()])[0]
    for cache in ({"policy": "deepcache", "interval": 1}, {"policy": "fbcache", "threshold": 0.0}):
        got = engine.generate([with_cache(make(), cache)])[0]
        assert got.ok, got.error
        assert got.timing.cached_steps == 0 and np.array_equal(pixels(got.image), pixels(plain.image)), cache


@pytest.mark.parametrize("make", [
    lambda: controlled(3, [("pose", 1.0, 0.0, 1.0)], steps=9),
    lambda: prompted(4, "style", 1.0, steps=9, guidance=1.0),
])
def test_deepcache_skips_what_its_interval_says(engine, make):
    plain = engine.generate([make()])[0]
    got = engine.generate([with_cache(make(), {"policy": "deepcache", "interval": 3})])[0]
    assert got.ok, got.error
    assert got.timing.cached_steps == 9 - math.ceil(9 / 3)
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 0  # it did reuse cached work


def mixed():
    return [with_cache(controlled(10, [("pose", 1.0, 0.0, 1.0)], steps=8), {"policy": "deepcache", "interval": 2}),
            with_cache(controlled(11, [("depth", 0.7, 0.0, 0.6), ("edge", 0.5, 0.3, 1.0)], guidance=1.0),
                       {"policy": "fbcache", "threshold": 0.3}),
            with_cache(prompted(12, "face", 0.9, steps=8), {"policy": "deepcache", "interval": 3}),
            controlled(13, [("pose", 0.8, 0.0, 1.0)]),
            with_cache(prompted(14, None, steps=8), "deepcache"),
            prompted(15, "style", 0.6, guidance=1.0),
            with_cache(prompted(16, "style", 1.2, guidance=6.0), {"policy": "fbcache", "threshold": 0.5})]


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image_and_skips(tiny_sd_path, folders, strategy):
    engine = make_engine(tiny_sd_path, folders, strategy)
    reqs = mixed()
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(mixed())
    assert all(r.ok for r in together), [r.error for r in together]
    assert sum(r.timing.cached_steps for r in together) > 0
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


@pytest.mark.parametrize("pooled", [False, True])
def test_the_shallow_controlnet_forward_gives_the_whole_forwards_first_outputs(engine, pooled):
    pipeline = engine.executor.pipeline
    net = engine.executor.controlnets().ensure(["pose"])["pose"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, pipeline.unet.config.in_channels, 8, 8, generator=g)
    t, e = torch.tensor([900.0, 400.0, 20.0]), torch.randn(3, 5, pipeline.unet.config.cross_attention_dim, generator=g)
    images = torch.rand(3, 3, 16, 16, generator=g)
    net.config.global_pool_conditions = pooled  # (read at each forward)
    try:  # under inference_mode, as the engine runs every forward (its weights may be inference tensors)
        with torch.inference_mode():
            whole = pipeline.control_forward(net, x, t, {"encoder_hidden_states": e}, images)
            part = pipeline.control_forward_shallow(net, x, t, {"encoder_hidden_states": e}, images)
    finally:
        net.config.global_pool_conditions = False
    keep = len(pipeline.unet.up_blocks[-1].resnets)
    assert list(part) == ["down_block_additional_residuals"] and len(part["down_block_additional_residuals"]) == keep
    for a, b in zip(part["down_block_additional_residuals"], whole["down_block_additional_residuals"]):
        assert torch.equal(a, b)


def test_reused_steps_run_the_controlnet_only_as_far_as_the_shallow_part_and_the_images_do_not_change(
        tiny_sd_path, folders, monkeypatch):
    from stepserve.executor import torch_executor

    def run(reqs):
        engine = make_engine(tiny_sd_path, folders)
        calls = {"whole": 0, "shallow": 0}
        pipeline = engine.executor.pipeline
        whole, shallow = pipeline.control_forward, pipeline.control_forward_shallow
        monkeypatch.setattr(pipeline, "control_forward",
                            lambda *a: (calls.__setitem__("whole", calls["whole"] + 1), whole(*a))[1])
        monkeypatch.setattr(pipeline, "control_forward_shallow",
                            lambda *a: (calls.__setitem__("shallow", calls["shallow"] + 1), shallow(*a))[1])
        return engine.generate(reqs), calls

    def reqs():
        deep = {"policy": "deepcache", "interval": 3}
        return [with_cache(controlled(40, [("pose", 1.0, 0.0, 1.0)], steps=9), deep),
                with_cache(controlled(41, [("depth", 0.8, 0.0, 1.0), ("pose", 0.5, 0.0, 1.0)], steps=9,
                                      guidance=1.0), deep),
                with_cache(controlled(42, [("edge", 0.9, 0.0, 1.0)], steps=9, guess=True), deep),
                controlled(43, [("pose", 0.7, 0.0, 1.0)], steps=9)]  # uncached: the whole ControlNet every step

    got, calls = run(reqs())
    assert calls["shallow"] > 0
    monkeypatch.setattr(torch_executor, "reuses_before", lambda row, have: False)  # every ControlNet runs whole
    want, before = run(reqs())
    assert before["shallow"] == 0 and calls["whole"] < before["whole"]
    for a, b in zip(got, want):
        assert a.ok and b.ok and a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
