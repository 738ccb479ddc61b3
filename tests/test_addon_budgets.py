"""Each add-on kind's default memory is sized for the dtype in force (defaults given for 16-bit weights, doubled
for float32, so a real ControlNet fits the default), --help says so, and the memory cap's line names each add-on
memory by its kind (not every one "for LoRA adapters")."""

from __future__ import annotations

import pytest

from stepserve import profiling
from stepserve.addons.budgets import AUTO, default_mb, memory_mb
from stepserve.commands import flags
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine

SD15_CONTROLNET_PARAMS = 361_278_340  # lllyasviel/control_v11p_sd15_canny
SDXL_CONTROLNET_PARAMS = 1_251_355_080  # diffusers/controlnet-canny-sdxl-1.0


@pytest.fixture(scope="module")
def tiny_executor(tiny_sd_path):
    from stepserve.engine.loading import load_executor

    return load_executor(str(tiny_sd_path))


@pytest.mark.parametrize("dtype, width", [("float32", 4), ("float16", 2), ("bfloat16", 2)])
def test_a_real_controlnet_fits_the_default_in_every_dtype(dtype, width):
    assert memory_mb("controlnet", AUTO, dtype) * 2**20 > SDXL_CONTROLNET_PARAMS * width > SD15_CONTROLNET_PARAMS
    assert default_mb("lora", "float32") == 2 * default_mb("lora", "float16")
    assert memory_mb("controlnet", 100.0, dtype) == 100.0 and memory_mb("controlnet", None, dtype) is None


def test_help_says_the_defaults_are_for_16_bit_weights_and_doubled_for_float32():
    import argparse

    p = argparse.ArgumentParser()
    flags.add_lora_flag(p)
    flags.add_controlnet_flag(p)
    text = " ".join(p.format_help().split())
    for mb in (1024, 3072, 6144):
        assert f"default: {mb} MB for 16-bit weights (--dtype float16/bfloat16), {2 * mb} MB for float32" in text


def test_the_memory_cap_line_names_each_add_on_memory(tiny_executor, monkeypatch, tmp_path):
    monkeypatch.setattr(profiling.memory, "memory_budget", lambda executor: (64 * 2**30, "in the test budget"))
    _, why = profiling.cap_max_batch_size(tiny_executor, 2, reserve_bytes={"LoRA adapters": 2**30,
                                                                          "ControlNets": 6 * 2**30})
    assert "less 1.0 GiB for LoRA adapters, 6.0 GiB for ControlNets" in why, why
    seen = {}

    def fake_cap(executor, requested, share=1.0, reserve_bytes=0):
        seen.update(reserve_bytes)
        return requested, "kept"

    monkeypatch.setattr("stepserve.profiling.cap_max_batch_size", fake_cap)
    build_engine(EngineConfig(lora_dir=str(tmp_path), lora_memory_mb=1024.0, warm_up=False,
                              options=EngineOptions(max_batch_size=2)), executor=tiny_executor, say=lambda _: None)
    assert seen == {"LoRA adapters": 2**30}  # the LoRA memory alone: the kinds not served keep nothing aside


def test_the_largest_published_ip_adapter_fits_the_default_in_16_bits():
    """SDXL's ip-adapter_sdxl with its ViT-bigG image encoder: about 1.85 billion parameters (encoder) and 0.35
    (adapter), 4.4 GB in 16 bits; the default IP-Adapter memory holds it in bfloat16 and float16."""
    from stepserve.addons.budgets import default_mb

    bytes_16bit = (1.85e9 + 0.35e9) * 2
    for dtype in ("bfloat16", "float16", "float32"):
        width = 4 if dtype == "float32" else 2
        assert default_mb("ip_adapter", dtype) * 2**20 >= bytes_16bit / 2 * width, dtype
