"""Several IP-Adapters on one request (`ip_adapter` as a list): alone, a request equals diffusers' pipeline with
load_ip_adapter of the list of adapters, set_ip_adapter_scale of the list of scales and one image per adapter (uint8
within 1, guidance on and off, either order); in mixed batches with one-adapter and plain rows, under every
strategy, each image is the one it gets alone."""

import numpy as np
import pytest
from edit_images import pixels, start_image
from ip_adapter_reference import diffusers_ip_adapter, request
from strategy_params import EVERY_STRATEGY

from stepserve import Engine
from stepserve.tiny.ipadapter import build_tiny_ip_adapter

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    """Two adapters with one image encoder (diffusers loads one encoder for a list of adapters: the first's)."""
    out = tmp_path_factory.mktemp("ip_adapters")
    for seed, name in enumerate(("face", "style"), start=1):
        build_tiny_ip_adapter(tiny_sd_path, out / name, seed=seed, std=0.2, encoder_seed=7)
    return out


@pytest.fixture(scope="module")
def engine(tiny_sd_path, folder):
    return Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                  ip_adapter_dir=str(folder))


def both(i, first="face", scales=(0.9, 0.6), guidance=4.0, **extra):
    p = request(i, None, guidance=guidance, **extra)
    second = "style" if first == "face" else "face"
    p.ip_adapter = [{"name": first, "image": start_image(60 + i), "scale": scales[0]},
                    {"name": second, "image": start_image(70 + i, size=40), "scale": scales[1]}]
    return p


@pytest.mark.parametrize("first, guidance", [("face", 4.0), ("style", 1.0)])
def test_alone_equals_diffusers_with_a_list_of_adapters(engine, tiny_sd_path, folder, first, guidance):
    p = both(1, first, scales=(0.9, 1.5), guidance=guidance)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_ip_adapter(tiny_sd_path, folder, p)).max() <= 1
    one = request(1, first, 0.9, guidance=guidance)
    one.ip_adapter["image"] = p.ip_adapter[0]["image"]
    alone = engine.generate([one])[0]
    assert np.abs(pixels(got.image) - pixels(alone.image)).max() > 4  # the second adapter did change the image


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
def test_mixed_batches_each_request_its_own_image(tiny_sd_path, folder, strategy):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy=strategy, max_batch_size=6, max_queue_delay_ms=1,
                                    ip_adapter_dir=str(folder))
    reqs = [both(20), request(21, "face", 0.7), request(22, None), both(23, "style", (1.2, 0.3), guidance=1.0),
            request(24, "style", 1.0, guidance=1.0, steps=8), both(25, scales=(0.0, 1.0), steps=8)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert all(r.ok for r in together), [r.error for r in together]
    if strategy != "none":
        assert max(max(r.timing.batch_sizes) for r in together) > 1, "the requests never shared a batch"
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
