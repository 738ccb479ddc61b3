"""A worker rank's add-ons follow rank 0's: a LoRA adapter loaded on rank 0 after start (as POST /v1/loras loads
it) serves on the next request; a ControlNet or IP-Adapter that rank 0 unloads for room is unloaded on the worker
too (its memory follows rank 0's budget), and a request's holds on the worker end with it."""

import numpy as np
import pytest
import torch
from control_reference import build_controlnets, request as controlled
from extras import require
from ip_adapter_reference import build_ip_adapters, request as prompted
from lora_reference import diffusers_sd, pixels

from stepserve import Engine, SamplingParams
from stepserve.parallel.degrees import Degrees
from stepserve.tiny.lora import build_tiny_lora

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def served(tiny_sd_path, tmp_path_factory):
    """(the --cfg-parallel engine over tiny SD with a LoRA, a ControlNet and an IP-Adapter folder, the LoRA
    folder): loaded once, closed at the end."""
    require("peft", "lora")
    loras = tmp_path_factory.mktemp("loras")
    threads = torch.get_num_threads()
    engine = Engine.from_pretrained(
        str(tiny_sd_path), degrees=Degrees(cfg=True), threads=1, memory_cap=False, strategy="continuous",
        max_batch_size=4, max_queue_delay_ms=1, lora_dir=str(loras),
        controlnet_dir=str(build_controlnets(tiny_sd_path, tmp_path_factory.mktemp("controlnets"))),
        ip_adapter_dir=str(build_ip_adapters(tiny_sd_path, tmp_path_factory.mktemp("ip_adapters"))))
    try:
        yield engine, loras
    finally:
        engine.executor.close()
        torch.set_num_threads(threads)  # the suite's (conftest): threads=1 set this process's


def test_a_lora_loaded_after_start_serves_on_the_next_request(served, tiny_sd_path):
    engine, loras = served
    file = build_tiny_lora(tiny_sd_path, loras / "late.safetensors", seed=4, std=0.4)
    engine.executor.adapters().load_within_budget("late", file)  # what POST /v1/loras does
    p = SamplingParams(prompt="a small cat 1", seed=31, num_inference_steps=4, guidance_scale=4.0,
                       sampler="dpmpp_2m", height=16, width=16, loras=[{"name": "late", "scale": 1.0}])
    plain = SamplingParams(**{**p.__dict__, "loras": None, "seed": 32})
    results = engine.generate([p, plain])
    assert all(r.ok for r in results), [r.error for r in results]
    assert np.abs(pixels(results[0].image) - diffusers_sd(tiny_sd_path, {"late": file}, p, [("late", 1.0)])).max() <= 1
    assert engine.executor.workers_state()[0]["lora"] == ["late"]
    engine.executor.adapters().delete("late")  # deleted on rank 0: unloaded on the worker
    assert engine.executor.workers_state()[0]["lora"] == []


@pytest.mark.parametrize("kind", ["controlnet", pytest.param("ip_adapter", marks=pytest.mark.slow)])
def test_an_addon_unloaded_on_rank_0_is_unloaded_on_the_worker(served, kind):
    engine, _ = served
    store = engine.executor.controlnets() if kind == "controlnet" else engine.executor.ip_adapters()
    first, second = (("pose", "depth") if kind == "controlnet" else ("face", "style"))

    def request(i, name):
        if kind == "controlnet":
            return controlled(i, controls=[(name, 1.0, 0.0, 1.0)], steps=3)
        return prompted(i, name, steps=3)

    assert engine.generate([request(0, first)])[0].ok
    assert first in engine.executor.workers_state()[0][kind]
    old = store.budget.budget_bytes
    store.budget.budget_bytes = int(store.budget.loaded_bytes * 1.5)  # room for one at a time on rank 0
    try:
        result = engine.generate([request(1, second)])[0]
        assert result.ok, result.error
        here = sorted(store.budget.sizes)
        assert first not in here and second in here  # unloaded on rank 0 for room
        worker = engine.executor.workers_state()[0]
        assert worker[kind] == here  # and on the worker (an IP-Adapter's shared image encoder stays)
        assert worker["held"] == []  # the finished requests' holds were released there
    finally:
        store.budget.budget_bytes = old


def test_a_lora_loaded_again_from_a_new_file_is_loaded_again_on_the_worker(served, tiny_sd_path):
    """Deleted on rank 0 and loaded again under its name from another file between two steps the worker saw: the
    worker's copy is the new weights, not the old ones kept under the same name and path."""
    engine, loras = served
    path = loras / "swap.safetensors"
    p = SamplingParams(prompt="a small cat 2", seed=41, num_inference_steps=3, guidance_scale=4.0,
                       sampler="dpmpp_2m", height=16, width=16, loras=[{"name": "swap", "scale": 1.0}])
    build_tiny_lora(tiny_sd_path, path, seed=5, std=0.4)
    engine.executor.adapters().load_within_budget("swap", path)
    assert engine.generate([p])[0].ok
    engine.executor.adapters().delete("swap")
    new = build_tiny_lora(tiny_sd_path, path, seed=6, std=0.4)  # same name, same path, other weights
    engine.executor.adapters().load_within_budget("swap", new)
    result = engine.generate([p])[0]  # the worker hears of the delete and the load in one message
    assert result.ok, result.error
    assert np.abs(pixels(result.image) - diffusers_sd(tiny_sd_path, {"swap": new}, p, [("swap", 1.0)])).max() <= 1
    engine.executor.adapters().delete("swap")
