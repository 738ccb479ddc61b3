"""The diffusers SD-family adapter: loading a local folder, model info, the prompt cache, shape buckets."""

import numpy as np
import pytest

from stepserve import Engine, SamplingParams, ValidationError
from stepserve.engine.loading import load_executor
from stepserve.pipelines.diffusers_sd import PromptCache, resolve_model_path
from tiny_sd import reference_image


def test_missing_folder_says_what_is_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        resolve_model_path(tmp_path / "nope")


def test_bad_device_and_dtype_name_allowed_values(tiny_sd_path):
    with pytest.raises(ValueError, match="allowed: float32, float16, bfloat16"):
        load_executor(str(tiny_sd_path), dtype="float64")
    with pytest.raises(ValueError, match="allowed: cpu, cuda"):
        load_executor(str(tiny_sd_path), device="tpu")


def test_model_info_from_folder(tiny_sd_path):
    info = load_executor(str(tiny_sd_path)).model_info
    assert (info.default_height, info.default_width) == (16, 16)  # unet sample_size 8 x vae factor 2
    assert info.size_multiple == 4 and info.default_sampler == "ddim"  # the folder's own DDIMScheduler
    assert "flow_euler" not in info.samplers  # an epsilon/v model is not a flow-matching model


def test_prompt_cache_is_lru_and_counts():
    cache = PromptCache(capacity=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)  # evicts b, the least recently used
    assert cache.get("b") is None and cache.get("c") == 3
    assert (cache.hits, cache.misses) == (2, 1)


def test_repeated_prompts_skip_the_text_encoder(tiny_sd_path):
    ex = load_executor(str(tiny_sd_path))
    ex.pipeline.encode_prompts(["x", "y", "x"])
    misses = ex.pipeline.prompt_cache.misses
    ex.pipeline.encode_prompts(["y", "x"])
    assert ex.pipeline.prompt_cache.misses == misses


def test_mixed_sizes_run_in_buckets_and_match_diffusers(tiny_sd_path):
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=4)
    reqs = [SamplingParams(prompt=f"s{i}", seed=i, num_inference_steps=3 + i, guidance_scale=4.0, sampler="euler",
                           height=[16, 24, 16, 8][i], width=[16, 16, 24, 8][i]) for i in range(4)]
    results = engine.generate(reqs)
    for r, p in zip(results, reqs):
        assert r.image.size == (p.width, p.height)
        diff = np.abs(np.asarray(r.image.convert("RGB"), dtype=np.int16) - reference_image(tiny_sd_path, p))
        assert diff.max() <= 1
    with pytest.raises(ValidationError, match="multiples of 4 from 8 to 32"):
        engine.generate([SamplingParams(prompt="x", height=18)])


def _configs(vae_blocks=2, unet_blocks=2, sample_size=8):
    from types import SimpleNamespace

    unet = SimpleNamespace(block_out_channels=(32,) * unet_blocks, sample_size=sample_size)
    vae = SimpleNamespace(block_out_channels=(16,) * vae_blocks)
    return unet, vae


def test_stepserve_json_may_narrow_the_sizes_a_folder_serves():
    from stepserve.pipelines.diffusers_sd import model_info_for

    unet, vae = _configs()  # native 16x16, sizes in steps of 4
    plain = model_info_for("m", unet, vae, {"_class_name": "DDIMScheduler"}, {})
    assert (plain.min_size, plain.max_size) == (8, 32)
    only = model_info_for("m", unet, vae, {}, {"min_size": 16, "max_size": 16})
    assert (only.min_size, only.max_size, only.default_height) == (16, 16, 16)
    for bad in ({"min_size": 20, "max_size": 16}, {"min_size": 6}, {"max_size": 12}):
        with pytest.raises(ValueError, match="stepserve.json: min_size"):
            model_info_for("m", unet, vae, {}, bad)
