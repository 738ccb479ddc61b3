"""The adapter store's memory and names: the per-layer stacks of mixed batches are counted in the budget and freed
with their adapter; an evicted adapter reloads from the file it was loaded from; a load that can never fit, or that
fails its checks, unloads nothing; a path the store cannot use is a LoraError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.lora import store as store_module
from stepserve.lora.errors import LoraError, LoraTooLargeError
from stepserve.tiny.lora import build_tiny_lora

from extras import require


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    require("peft", "lora")
    root = tmp_path_factory.mktemp("lora_store")
    build_tiny_lora("embedded", root / "ink.safetensors", seed=1, rank=4, std=0.3)
    build_tiny_lora("embedded", root / "oil.safetensors", seed=4, rank=4, std=0.3)
    build_tiny_lora("embedded", root / "spare" / "chalk.safetensors", seed=2, rank=4, std=0.3)
    build_tiny_lora("embedded", root / "other" / "ink.safetensors", seed=3, rank=4, std=0.3)
    build_tiny_lora("embedded", root / "wide.safetensors", seed=5, rank=32, std=0.05)
    (root / "junk.safetensors").write_bytes(b"not a safetensors file")
    return root


def store_of(folder, budget=None):
    engine = Engine.from_pretrained("embedded", strategy="continuous", max_batch_size=4)
    return engine, engine.executor.adapters(folder, budget)


def image(engine, *names, seed=3):
    return np.asarray(engine.generate([SamplingParams(prompt="seven", seed=seed, num_inference_steps=3,
                                                      loras=[{"name": n} for n in names])])[0].image)


def stack_tensors(module) -> list[torch.Tensor]:
    """Every tensor the adapted layers hold in their stacks for mixed batches (attributes _stepserve_stack*)."""
    def walk(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            for v in value:
                yield from walk(v)
        elif isinstance(value, dict):
            for v in value.values():
                yield from walk(v)

    return [t for layer in module.modules() for attr, value in vars(layer).items()
            if attr.startswith("_stepserve_stack") for t in walk(value)]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_stacks_are_counted_in_the_budget_and_freed_on_delete_and_eviction(folder):
    engine, store = store_of(folder)
    store.load("ink", folder / "ink.safetensors")
    store.load("wide", folder / "wide.safetensors")
    results = engine.generate([SamplingParams(prompt="seven", seed=s, num_inference_steps=2, loras=[{"name": n}])
                               for s, n in ((1, "ink"), (2, "wide"))])
    assert max(max(r.timing.batch_sizes) for r in results) == 2  # one mixed batch: the rows gather from stacks
    held = nbytes(stack_tensors(store.module))
    counted = sum(a.stack_bytes for a in store.adapters.values())
    # each adapter's slots at its own rank: rank 4 beside rank 32 is not padded to 32 (that would take ~1.9x)
    assert 0 < held <= counted and store.loaded_bytes == sum(a.bytes + a.stack_bytes for a in store.adapters.values())
    store.delete("wide")
    assert stack_tensors(store.module) == []  # freed with the adapter, not at the next mixed batch

    store.load("wide", folder / "wide.safetensors")
    engine.generate([SamplingParams(prompt="seven", seed=s, num_inference_steps=2, loras=[{"name": n}])
                     for s, n in ((1, "ink"), (2, "wide"))])
    assert nbytes(stack_tensors(store.module)) > 0
    store.budget_bytes = store.loaded_bytes  # no room for one more: oil evicts the idle one
    store.ensure(["oil"], in_use={"ink"})
    assert sorted(store.adapters) == ["ink", "oil"] and store.evictions == 1
    assert stack_tensors(store.module) == []


def test_posted_adapters_come_back_with_their_own_weights_after_eviction(folder):
    engine, store = store_of(folder)
    store.load_within_budget("chalk", "spare/chalk.safetensors")  # POSTed from a subfolder
    store.budget_bytes = store.loaded_bytes  # room for one rank-4 adapter
    chalk = image(engine, "chalk")
    store.load_within_budget("ink", "other/ink.safetensors")  # POSTed under the name of the folder's ink
    assert "chalk" not in store.adapters and "chalk" in store.names  # evicted, still servable
    ink = image(engine, "ink")
    assert np.array_equal(image(engine, "chalk"), chalk)  # reloaded from spare/ (ink evicted)
    assert np.array_equal(image(engine, "ink"), ink)  # reloaded from other/, not the folder's ink
    assert store.adapters["ink"].path == "other/ink.safetensors" and store.evictions == 3
    store.delete("chalk")  # evicted: deleting it forgets its file, it is no longer servable
    assert "chalk" not in store.names
    store.delete("ink")  # a deleted POST is forgotten: the name is the folder's file again
    assert not np.array_equal(image(engine, "ink"), ink)
    assert store.adapters["ink"].path == "ink.safetensors"


def test_an_adapter_over_the_whole_budget_is_refused_and_nothing_is_evicted(folder):
    engine, store = store_of(folder)
    store.ensure(["ink"])
    store.budget_bytes = 3 * store.loaded_bytes  # room for three rank-4 adapters, not for one of rank 32
    for attempt in (lambda: store.ensure(["wide"]), lambda: store.load_within_budget("big", "wide.safetensors")):
        with pytest.raises(LoraTooLargeError, match="larger than the whole adapter memory"):
            attempt()
        assert sorted(store.adapters) == ["ink"] and store.evictions == 0


@pytest.mark.parametrize("name,path,says", [
    ("bad name!", "oil.safetensors", "letters, digits"),
    ("x", "missing.safetensors", "no such file"),
    ("x", "junk.safetensors", "is not a LoRA file"),
    ("x", "spare", "a folder without pytorch_lora_weights.safetensors"),
    ("x", "oil\0.safetensors", "NUL"),
    ("x", "../ink.safetensors", "outside the adapter folder"),
    ("ink", "oil.safetensors", "already loaded"),
])
def test_a_bad_load_evicts_nothing(folder, monkeypatch, name, path, says):
    engine, store = store_of(folder)
    store.ensure(["ink"])
    monkeypatch.setattr(store_module, "MAX_ADAPTERS", 1)  # full: a good load would evict ink
    with pytest.raises(LoraError, match=says) as caught:
        store.load_within_budget(name, path)
    assert sorted(store.adapters) == ["ink"] and store.evictions == 0
    assert str(folder) not in str(caught.value)  # no server path in the message
