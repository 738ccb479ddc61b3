"""The TensorRT optimization profiles computed from the serving settings: guidance doubling, buckets, the opt
batch, the decode cap and the served sizes; every batch the server can run lies inside every profile."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepserve.deploy.tensorrt_profiles import (
    InputSpec,
    ServingSettings,
    SizeRange,
    TensorProfile,
    network_profiles,
)

SD_INPUTS = {  # as `stepserve export onnx` states them for an SD 1.x model
    "text_encoder": (InputSpec("input_ids", "int64", ("batch", 77)),),
    "unet": (InputSpec("sample", "float", ("batch", 4, "latent_height", "latent_width")),
             InputSpec("timestep", "float", ("batch",)),
             InputSpec("encoder_hidden_states", "float", ("batch", 77, 768))),
    "vae_decoder": (InputSpec("latent_sample", "float", ("batch", 4, "latent_height", "latent_width")),),
}
SD_SIZES = SizeRange(min_size=256, max_size=1024, default_height=512, default_width=768, vae_scale=8)


def profiles(**kw):
    return {p.network: p for p in network_profiles(SD_INPUTS, SD_SIZES, ServingSettings(**kw))}


# --- profiles ----------------------------------------------------------------------------------------------------
def test_guidance_doubles_the_denoiser_and_text_encoder_rows_but_not_the_decoder():
    p = profiles(max_batch_size=8)
    assert p["unet"].batch_range == (1, 16, 16)
    assert p["text_encoder"].batch_range == (1, 16, 16)
    assert p["vae_decoder"].batch_range == (1, 8, 8)
    unet = p["unet"]
    assert unet.input("sample") == TensorProfile("sample", (1, 4, 32, 32), (16, 4, 64, 96), (16, 4, 128, 128))
    assert unet.input("timestep") == TensorProfile("timestep", (1,), (16,), (16,))
    assert unet.input("encoder_hidden_states") == TensorProfile("encoder_hidden_states", (1, 77, 768),
                                                                (16, 77, 768), (16, 77, 768))
    assert p["text_encoder"].input("input_ids") == TensorProfile("input_ids", (1, 77), (16, 77), (16, 77))
    assert p["vae_decoder"].input("latent_sample").opt == (8, 4, 64, 96)


def test_without_guidance_no_network_is_doubled():
    p = profiles(max_batch_size=8, cfg=False)
    assert [p[n].batch_range for n in ("text_encoder", "unet", "vae_decoder")] == [(1, 8, 8)] * 3


def test_buckets_set_the_largest_batch_and_the_opt_batch_is_the_bucket_a_full_batch_pads_to():
    p = profiles(max_batch_size=6, buckets=(1, 2, 4, 8))
    assert p["unet"].batch_range == (1, 16, 16)  # a batch of 5 or 6 runs padded to 8, plus 8 guidance rows
    assert p["vae_decoder"].batch_range == (1, 8, 8)
    p = profiles(max_batch_size=3, buckets=(8, 1, 4, 2))
    assert p["unet"].batch_range == (1, 8, 16)  # a full batch of 3 pads to 4: opt 4 requests, 8 rows


def test_opt_batch_flag_and_decode_cap():
    p = profiles(max_batch_size=8, opt_batch=2, max_decode_per_step=3)
    assert p["unet"].batch_range == (1, 4, 16)
    assert p["vae_decoder"].batch_range == (1, 2, 3)
    assert profiles(max_batch_size=8, max_decode_per_step=2)["vae_decoder"].batch_range == (1, 2, 2)


@pytest.mark.parametrize("kw, words", [
    ({"max_batch_size": 0}, "max_batch_size: 0"),
    ({"max_batch_size": 8, "buckets": (1, 2, 4)}, "largest bucket 4 is below max_batch_size 8"),
    ({"max_batch_size": 8, "buckets": (0, 8)}, "each bucket must be an integer >= 1"),
    ({"max_batch_size": 6, "buckets": (1, 2, 4, 8), "opt_batch": 3}, "opt_batch: 3 is not one of the buckets 1,2,4,8"),
    ({"max_batch_size": 8, "opt_batch": 9}, "from 1 to 8"),
    ({"max_batch_size": 8, "max_decode_per_step": 0}, "max_decode_per_step: 0"),
])
def test_bad_settings_say_what_is_allowed(kw, words):
    with pytest.raises(ValueError, match=words):
        ServingSettings(**kw)


def test_an_axis_the_exporter_does_not_know_is_refused():
    inputs = dict(SD_INPUTS, text_encoder=(InputSpec("input_ids", "int64", ("batch", "sequence")),))
    with pytest.raises(ValueError, match=r"text_encoder.input_ids: axis 'sequence'"):
        network_profiles(inputs, SD_SIZES, ServingSettings())


@settings(max_examples=200, deadline=None)
@given(max_batch=st.integers(1, 64), buckets=st.lists(st.integers(1, 128), max_size=6), cfg=st.booleans(),
       decode_cap=st.one_of(st.none(), st.integers(1, 64)), data=st.data())
def test_every_batch_the_server_can_run_is_inside_every_profile(max_batch, buckets, cfg, decode_cap, data):
    if buckets:
        buckets.append(data.draw(st.integers(max_batch, 128)))  # a full batch must be paddable
    s = ServingSettings(max_batch_size=max_batch, buckets=tuple(buckets), cfg=cfg, max_decode_per_step=decode_cap)
    p = {n.network: n for n in network_profiles(SD_INPUTS, SD_SIZES, s)}
    runnable = s.buckets or tuple(range(1, max_batch + 1))  # request batches the denoiser can be handed
    for n in runnable:
        for guided in (0, n) if cfg else (0,):
            assert p["unet"].input("sample").contains((n + guided, 4, 64, 96))
            assert p["unet"].input("timestep").contains((n + guided,))
            assert p["text_encoder"].input("input_ids").contains((n + guided, 77))
        assert p["vae_decoder"].input("latent_sample").contains((min(n, decode_cap or n), 4, 32, 128))
    for net in p.values():
        lo, opt, hi = net.batch_range
        assert 1 == lo <= opt <= hi
        for t in net.inputs:
            assert all(a <= b <= c for a, b, c in zip(t.min, t.opt, t.max))
            assert t.contains(t.min) and t.contains(t.opt) and t.contains(t.max)
    assert not p["unet"].input("sample").contains((p["unet"].batch_range[2] + 1, 4, 64, 64))
