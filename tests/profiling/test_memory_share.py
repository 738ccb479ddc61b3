"""The memory cap counts only this engine's share of the free memory, and measures the rows guidance can add."""

from __future__ import annotations

from dataclasses import replace

import pytest

from stepserve import profiling
from stepserve.engine.config import EngineConfig, EngineOptions, build_engine


@pytest.fixture(scope="module")
def tiny_executor(tiny_sd_path):
    from stepserve.engine.loading import load_executor

    return load_executor(str(tiny_sd_path))


def test_a_share_of_the_budget_caps_lower(tiny_executor, monkeypatch):
    peaks = profiling.measure_peak_memory(tiny_executor, [1, 2, 4], bucket=(32, 32))
    budget = peaks[4] * 10 / 0.8
    monkeypatch.setattr(profiling.memory, "memory_budget", lambda executor: (int(budget), "in the test budget"))
    whole, _ = profiling.cap_max_batch_size(tiny_executor, 64)
    half, why = profiling.cap_max_batch_size(tiny_executor, 64, share=0.5)
    assert half == profiling.memory_cap(peaks, int(budget * 0.5), 0.2) and half < whole, (half, whole)
    assert "50% share of" in why, why
    with pytest.raises(ValueError, match="share"):
        profiling.cap_max_batch_size(tiny_executor, 8, share=0.0)


def test_lora_adapters_memory_is_kept_out_of_the_budget(tiny_executor, monkeypatch):
    peaks = profiling.measure_peak_memory(tiny_executor, [1, 2, 4], bucket=(32, 32))
    budget = peaks[4] * 10 / 0.8
    monkeypatch.setattr(profiling.memory, "memory_budget", lambda executor: (int(budget), "in the test budget"))
    whole, _ = profiling.cap_max_batch_size(tiny_executor, 64)
    reserved, why = profiling.cap_max_batch_size(tiny_executor, 64, reserve_bytes={"LoRA adapters": int(budget / 2)})
    assert reserved == profiling.memory_cap(peaks, int(budget) - int(budget / 2), 0.2) and reserved < whole
    assert "for LoRA adapters" in why, why


def test_memory_budget_takes_a_share(tiny_executor):
    whole, _ = profiling.memory_budget(tiny_executor)
    part, what = profiling.memory_budget(tiny_executor, share=0.25)
    assert part == pytest.approx(whole * 0.25, rel=0.05) and "25% share" in what


def test_build_engine_passes_the_engine_config_share(tiny_executor, monkeypatch):
    seen = {}

    def fake_cap(executor, requested, share=1.0, reserve_bytes=0):
        seen["share"], seen["reserve"] = share, reserve_bytes
        return requested, "kept"

    monkeypatch.setattr("stepserve.profiling.cap_max_batch_size", fake_cap)
    build_engine(EngineConfig(memory_share=0.5, options=EngineOptions(max_batch_size=2)), executor=tiny_executor)
    assert seen["share"] == 0.5


@pytest.mark.parametrize("default", [1.0, 0.0])
def test_a_model_whose_default_takes_no_guidance_row_is_measured_with_it(tiny_executor, monkeypatch, default):
    """A request may ask for guidance_scale > 1 whatever the model's default: two denoiser rows per request."""
    model = replace(tiny_executor.model_info, default_guidance_scale=default)
    monkeypatch.setattr(tiny_executor, "model_info", model, raising=False)
    scales = []
    prepare = tiny_executor.prepare

    def spy(requests):
        scales.extend(r.params.guidance_scale for r in requests)
        return prepare(requests)

    monkeypatch.setattr(tiny_executor, "prepare", spy)
    profiling.measure_peak_memory(tiny_executor, [1, 2])
    assert scales and all(s > 1 for s in scales), scales
    assert profiling.memory.measured_guidance(replace(model, guidance="embedded")) is None
    assert profiling.memory.measured_guidance(replace(model, default_guidance_scale=5.0)) is None
