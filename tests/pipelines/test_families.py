"""The family interface: model_index.json `_class_name` picks the adapter; exported backends stay SD 1/2 only;
per-family request rules are enforced with messages that say what is allowed."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from stepserve import SamplingParams, ValidationError
from stepserve.pipelines.diffusers_sd import StableDiffusionAdapter
from stepserve.pipelines.family import Conditioning, stack_rows
from stepserve.pipelines.prompt_cache import PromptCache
from stepserve.pipelines.registry import (
    FAMILIES,
    UnsupportedModelError,
    adapter_class,
    load_family_adapter,
    pipeline_class_name,
    require_export_family,
)
from stepserve.request.validation import resolve_params


def _with_class_name(src, dst, name):
    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    index["_class_name"] = name
    (dst / "model_index.json").write_text(json.dumps(index))
    return dst


def test_the_class_name_picks_the_adapter(tiny_sd_path):
    assert pipeline_class_name(tiny_sd_path) == "StableDiffusionPipeline"
    assert pipeline_class_name("embedded") == "StableDiffusionPipeline"
    adapter = load_family_adapter(tiny_sd_path)
    assert isinstance(adapter, StableDiffusionAdapter) and adapter.info.family == "sd"
    for name in FAMILIES:  # every registered target imports and names a class
        assert isinstance(adapter_class(name), type)


def test_unknown_pipeline_class_names_what_is_supported(tiny_sd_path, tmp_path):
    folder = _with_class_name(tiny_sd_path, tmp_path / "odd", "KandinskyPipeline")
    with pytest.raises(UnsupportedModelError, match="'KandinskyPipeline' is not supported; supported: .*"
                                                    "StableDiffusionPipeline"):
        load_family_adapter(folder)


def test_exported_backends_refuse_other_families(tiny_sd_path, tmp_path):
    require_export_family(tiny_sd_path, "onnxruntime")  # SD 1/2: fine
    folder = _with_class_name(tiny_sd_path, tmp_path / "xl", "StableDiffusionXLPipeline")
    with pytest.raises(UnsupportedModelError, match="backend 'onnxruntime' serves StableDiffusionPipeline folders "
                                                    "only; .* is a StableDiffusionXLPipeline"):
        require_export_family(folder, "onnxruntime")
    from stepserve.engine.loading import load_executor

    with pytest.raises(UnsupportedModelError, match="StableDiffusionXLPipeline"):
        load_executor(str(folder), backend="onnxruntime")


def test_sd_conditioning_has_an_uncond_row_only_with_guidance(tiny_sd_path):
    adapter = load_family_adapter(tiny_sd_path)
    conds = adapter.encode([SamplingParams(prompt="a", guidance_scale=1.0), SamplingParams(prompt="b",
                                                                                            guidance_scale=3.0)])
    assert [c.guided for c in conds] == [False, True]
    rows = stack_rows([conds[0].cond, conds[1].cond, conds[1].uncond])
    assert rows["encoder_hidden_states"].shape[0] == 3
    # the unconditional row is the empty negative prompt's embedding, as StableDiffusionPipeline encodes it
    assert torch.equal(conds[1].uncond["encoder_hidden_states"][0], adapter.encode_prompts([""])[0])


def test_prompt_cache_encodes_each_distinct_missing_prompt_once():
    cache, calls = PromptCache(), []

    def encode(prompts):
        calls.append(list(prompts))
        return [p.upper() for p in prompts]

    assert cache.encode(["a", "b", "a"], encode) == ["A", "B", "A"]
    assert cache.encode(["b", "c"], encode) == ["B", "C"]
    assert calls == [["a", "b"], ["c"]]


def test_prompt_cache_entries_do_not_pin_the_encoder_batch():
    batch = torch.arange(4 * 3 * 2, dtype=torch.float32).reshape(4, 3, 2)  # an encoder's batched output
    pooled = torch.ones(4, 5)
    cache = PromptCache()
    rows = cache.encode(["a", "b", "c", "d"], lambda ps: [(batch[i], {"pooled": pooled[i]}) for i in range(len(ps))])
    for i, (row, extra) in enumerate(rows):
        assert torch.equal(row, batch[i])
        # its own storage, the size of the row: the batch can be freed while the entry lives
        assert row.untyped_storage().data_ptr() != batch.untyped_storage().data_ptr()
        assert row.untyped_storage().nbytes() == row.numel() * row.element_size()
        assert extra["pooled"].untyped_storage().nbytes() == 5 * 4
    assert cache.get("b")[0] is rows[1][0]


def test_family_rules_in_validation(tiny_sd_path):
    info = load_family_adapter(tiny_sd_path).info
    no_negative = replace(info, family="flux", negative_prompt=False, guidance="embedded")
    with pytest.raises(ValidationError, match=r"negative_prompt: .*\(flux\) takes no negative prompt; allowed: empty"):
        resolve_params(SamplingParams(prompt="x", negative_prompt="blurry"), no_negative)
    assert resolve_params(SamplingParams(prompt="x"), no_negative).negative_prompt == ""
    with pytest.raises(ValidationError, match="guidance embedding"):
        resolve_params(SamplingParams(prompt="x", guidance_scale=-1.0), no_negative)
    with pytest.raises(ValidationError, match="<= 1 disables guidance"):
        resolve_params(SamplingParams(prompt="x", guidance_scale=-1.0), info)


def test_conditioning_without_uncond_is_not_guided():
    c = Conditioning({"x": torch.zeros(1, 2)})
    assert not c.guided and Conditioning(c.cond, {"x": torch.ones(1, 2)}).guided


def test_the_executor_guides_through_the_adapters_hooks(tiny_sd_path):
    """A family may override collate and combine_guidance: the executor calls them. With a combine that keeps
    the conditional prediction, a guided request gives the image of the same request without guidance."""
    import numpy as np

    from stepserve import Engine
    from stepserve.engine.loading import load_executor

    executor = load_executor(str(tiny_sd_path))
    adapter = executor.pipeline
    collated = []
    adapter.collate = lambda rows: collated.append(len(rows)) or stack_rows(rows)
    adapter.combine_guidance = lambda cond, uncond, scale: cond
    p = SamplingParams(prompt="hook", seed=3, num_inference_steps=3, sampler="euler")
    guided, plain = Engine(executor).generate([replace(p, guidance_scale=5.0), replace(p, guidance_scale=1.0)])
    assert collated and max(collated) == 3  # two conditional rows and one unconditional row
    diff = np.abs(np.asarray(guided.image, dtype=np.int16) - np.asarray(plain.image, dtype=np.int16))
    assert diff.max() <= 1
