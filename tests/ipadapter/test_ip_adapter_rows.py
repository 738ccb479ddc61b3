"""How a step runs its image prompts: the image encoder runs once for the requests admitted together; a batch
without image prompts runs the plain UNet (no IP processor, no image projection); rows that cache steps share the
forward with image-prompt rows; rows of different adapters share one forward, each its own adapter's image; the
adapters loaded stay within their memory (the least recently used idle one unloaded first, one in use never)."""

import numpy as np
import pytest
from edit_images import pixels
from ip_adapter_reference import build_ip_adapters, diffusers_ip_adapter, request

from stepserve import Engine
from stepserve.ipadapter import rows

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def folder(tiny_sd_path, tmp_path_factory):
    return build_ip_adapters(tiny_sd_path, tmp_path_factory.mktemp("ip_adapters"), std=0.2)


def test_embeddings_once_per_admitted_group_and_plain_batches_run_the_plain_unet(tiny_sd_path, folder,
                                                                                monkeypatch):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="static", static_batch_size=4, max_batch_size=4,
                                    ip_adapter_dir=str(folder))
    encoded, scaled = [], []
    embed, forward = rows.embed, rows.RowScaled.forward
    monkeypatch.setattr(rows, "embed", lambda loaded, images: (encoded.append(len(images)), embed(loaded, images))[1])
    monkeypatch.setattr(rows.RowScaled, "forward", lambda self, x: (scaled.append(x.shape[0]), forward(self, x))[1])
    unet = engine.executor.pipeline.unet
    plain = {name: type(p) for name, p in unet.attn_processors.items()}
    results = engine.generate([request(1, "face", 1.0), request(2, None), request(3, "face", 0.5, guidance=1.0),
                               request(4, "face", 0.8)])
    assert all(r.timing.batch_sizes == [4] * 6 for r in results)
    assert encoded == [3]  # one encoder pass for the three image prompts admitted together
    assert set(scaled) == {4 + 3}  # every row of the forward (three guided requests add their unconditional rows)
    assert {name: type(p) for name, p in unet.attn_processors.items()} == plain and unet.encoder_hid_proj is None
    scaled.clear()
    seen = []
    hook = unet.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (m.encoder_hid_proj, {type(p) for p in m.attn_processors.values()}, kwargs.get("added_cond_kwargs"))),
        with_kwargs=True)
    try:
        engine.generate([request(5, None), request(6, None, guidance=1.0)])
    finally:
        hook.remove()
    assert scaled == [] and seen and all(s == (None, set(plain.values()), None) for s in seen)


def test_cached_rows_and_image_prompt_rows_share_a_forward(tiny_sd_path, folder):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                    ip_adapter_dir=str(folder))
    reqs = [request(30, None, cache={"policy": "deepcache", "interval": 2}), request(31, "face", 1.0),
            request(32, None, cache={"policy": "fbcache", "threshold": 0.5}, guidance=1.0),
            request(33, "face", 0.7, guidance=1.0)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(together[0].timing.batch_sizes) == 4 and together[0].timing.cached_steps > 0
    for a, b in zip(alone, together):
        assert b.ok, b.error
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
    assert np.abs(pixels(together[3].image) - diffusers_ip_adapter(tiny_sd_path, folder, reqs[3])).max() <= 1


def test_rows_of_different_adapters_share_a_forward_each_with_its_own_image(tiny_sd_path, folder, monkeypatch):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                    ip_adapter_dir=str(folder))
    store = engine.executor.ip_adapters()
    assert store.listing() == [{"name": n, "loaded": False, "bytes": None} for n in ("face", "style")]
    reqs = [request(40, "face", 1.0), request(41, "style", 0.8), request(42, None), request(43, "style", 1.0,
                                                                                             guidance=1.0)]
    alone = [engine.generate([p])[0] for p in reqs]
    assert set(store.loaded) == {"face", "style"} and store.loads == 2 and store.evictions == 0
    assert [a["loaded"] for a in store.listing()] == [True, True]
    adapters_per_forward = []
    forward = rows.RowScaled.forward
    monkeypatch.setattr(rows.RowScaled, "forward", lambda self, x: (adapters_per_forward.append(self.name),
                                                                    forward(self, x))[1])
    together = engine.generate(reqs)
    assert all(r.timing.batch_sizes == [4] * 6 for r in together)
    assert set(adapters_per_forward) == {"face", "style"}  # both adapters' image attention in the shared forwards
    for p, a, b in zip(reqs, alone, together):
        assert a.ok and b.ok, (a.error, b.error)
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
    for p, b in zip(reqs[:2], together[:2]):
        assert np.abs(pixels(b.image) - diffusers_ip_adapter(tiny_sd_path, folder, p)).max() <= 1


def test_the_adapters_memory_unloads_the_least_recently_used_idle_one(tiny_sd_path, folder):
    probe = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", ip_adapter_dir=str(folder))
    size = probe.executor.ip_adapters().ensure("face").bytes  # the tiny adapters are the same size
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8,
                                    ip_adapter_dir=str(folder), ip_adapter_memory_mb=1.5 * size / 2**20)
    store = engine.executor.ip_adapters()
    engine.generate([request(60, "face", 1.0)])
    p = request(61, "style", 1.0)
    got = engine.generate([p])[0]  # face is idle: unloaded for style
    assert got.ok and set(store.loaded) == {"style"} and store.evictions == 1
    assert np.abs(pixels(got.image) - diffusers_ip_adapter(tiny_sd_path, folder, p)).max() <= 1
    # Both at once: the second does not fit beside the first, which serves the step; it fails alone, the others go on.
    style, face, plain = engine.generate([request(62, "style", 1.0), request(63, "face", 1.0), request(64, None)])
    assert style.ok and plain.ok and not face.ok
    assert "does not fit the IP-Adapter memory" in face.error and "retry later" in face.error
    tight = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", ip_adapter_dir=str(folder),
                                   ip_adapter_memory_mb=0.5 * size / 2**20)
    never = tight.generate([request(65, "face", 1.0)])[0]
    assert not never.ok and "larger than the whole IP-Adapter memory" in never.error


def test_the_model_folders_feature_extractor_prepares_the_image_as_in_diffusers(tiny_sd_path, folder, tmp_path):
    """A model folder with a feature extractor (SD 1.5's has one): diffusers' load_ip_adapter keeps it, so the
    image is prepared with its settings, not the default ones."""
    import json
    import shutil

    from transformers import CLIPImageProcessor

    model = tmp_path / "pipe"
    shutil.copytree(tiny_sd_path, model)
    CLIPImageProcessor(size=32, crop_size=32, image_mean=[0.2, 0.5, 0.8], image_std=[0.3, 0.2, 0.4],
                       do_center_crop=False).save_pretrained(model / "feature_extractor")
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "feature_extractor": ["transformers",
                                                                                       "CLIPImageProcessor"]}))
    engine = Engine.from_pretrained(str(model), strategy="continuous", ip_adapter_dir=str(folder))
    p = request(50, "face", 1.0)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - diffusers_ip_adapter(model, folder, p)).max() <= 1
