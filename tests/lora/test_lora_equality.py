"""LoRA adapters per request: a request alone equals diffusers' pipeline after load_lora_weights and set_adapters
with the same scales (uint8 within 1), for SD (UNet) and Flux (transformer); in a batch with other adapters,
plain rows and step-cached rows each image is the one it gets alone."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.tiny.lora import build_tiny_lora

from extras import require
from lora_reference import diffusers_sd, pixels

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)


@pytest.fixture(scope="module")
def sd(tiny_sd_path, tmp_path_factory):
    require("peft", "lora")
    out = tmp_path_factory.mktemp("loras")
    files = {"a": build_tiny_lora(tiny_sd_path, out / "a.safetensors", seed=1, rank=4, std=0.4),
             "b": build_tiny_lora(tiny_sd_path, out / "b.safetensors", seed=2, rank=8, alpha=16, std=0.3),
             "c": build_tiny_lora(tiny_sd_path, out / "c.safetensors", seed=3, rank=2, targets=("to_k", "to_v"))}
    engine = Engine.from_pretrained(str(tiny_sd_path), strategy="continuous", max_batch_size=8)
    for name, path in files.items():
        engine.executor.adapters().load(name, path)
    return engine, files


CASES = [(("a", 1.0),), (("b", 0.6),), (("a", 0.7), ("b", 0.5)), (("c", -1.5), ("a", 2.0))]


def params(i, loras, cache=None, guidance=4.0, steps=6):
    return SamplingParams(prompt=f"a small cat {i}", seed=300 + i, num_inference_steps=steps, guidance_scale=guidance,
                          sampler="dpmpp_2m", height=16, width=16, cache=cache,
                          loras=[{"name": n, "scale": s} for n, s in loras])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sd_alone_equals_diffusers_set_adapters(sd, tiny_sd_path, case):
    engine, files = sd
    p = params(case, CASES[case])
    got = engine.generate([p])[0]
    want = diffusers_sd(tiny_sd_path, files, p, CASES[case])
    plain = engine.generate([params(case, ())])[0]
    assert np.abs(pixels(got.image) - want).max() <= 1
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 8  # the adapter did change the image


def test_sd_mixed_batch_each_row_its_own_adapters(sd):
    engine, _ = sd
    loras = [(), (("a", 1.0),), (("b", 0.6), ("a", 0.3)), (("c", 1.0),), (("a", 0.5), ("b", 0.5), ("c", 0.5))]
    caches = [None, None, {"policy": "deepcache", "interval": 2}, None, {"policy": "fbcache", "threshold": 0.3}]
    reqs = [params(10 + i, loras[i % 5], cache=caches[(i // 5 + i) % 5], guidance=[1.0, 5.0][i % 2],
                   steps=[5, 8, 6][i % 3]) for i in range(12)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    require("peft", "lora")
    from stepserve.tiny.flux import build_tiny_flux

    path = build_tiny_flux(tmp_path_factory.mktemp("flux_lora") / "pipe", variant="dev")
    out = tmp_path_factory.mktemp("flux_loras")
    files = {"x": build_tiny_lora(path, out / "x.safetensors", seed=5, rank=4, std=0.3),
             "y": build_tiny_lora(path, out / "y.safetensors", seed=6, rank=8, alpha=4, std=0.3,
                                  targets=("to_q", "to_v"))}
    engine = Engine.from_pretrained(str(path), strategy="continuous", max_batch_size=8)
    for name, file in files.items():
        engine.executor.adapters().load(name, file)
    return path, engine, files


@pytest.mark.parametrize("loras", [(("x", 1.0),), (("y", 0.8), ("x", -0.5))])
def test_flux_alone_equals_diffusers_set_adapters(flux, loras):
    import diffusers

    path, engine, files = flux
    p = SamplingParams(prompt="a tiny lighthouse", seed=41, num_inference_steps=5, guidance_scale=3.5, height=32,
                       width=32, loras=[{"name": n, "scale": s} for n, s in loras])
    got = engine.generate([p])[0]
    pipe = diffusers.FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    for name, _ in loras:
        pipe.load_lora_weights(str(files[name]), adapter_name=name)
    pipe.set_adapters([n for n, _ in loras], [s for _, s in loras])
    want = pipe(p.prompt, height=32, width=32, num_inference_steps=5, guidance_scale=3.5,
                generator=torch.Generator("cpu").manual_seed(41), output_type="np").images[0]
    assert np.abs(pixels(got.image) - (want * 255).round().astype(np.int16)).max() <= 1
    plain = engine.generate([SamplingParams(prompt="a tiny lighthouse", seed=41, num_inference_steps=5,
                                            guidance_scale=3.5, height=32, width=32)])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 8


def test_flux_mixed_batch_with_adapters_and_caching(flux):
    _, engine, _ = flux
    loras = [(), (("x", 1.0),), (("y", 0.8), ("x", -0.5)), (("y", 1.0),)]
    caches = [None, {"policy": "magcache", "threshold": 0.5}, None, {"policy": "fbcache", "threshold": 0.6}, "off"]
    reqs = [SamplingParams(prompt=f"a tiny lighthouse {i}", seed=50 + i, num_inference_steps=[6, 9][i % 2],
                           guidance_scale=3.5, height=32, width=32, cache=caches[i % 5],
                           loras=[{"name": n, "scale": s} for n, s in loras[i % 4]]) for i in range(10)]
    alone = [engine.generate([p])[0] for p in reqs]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    for a, b in zip(alone, together):
        assert a.timing.cached_steps == b.timing.cached_steps
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1


def test_an_adapter_of_the_text_encoder_too_equals_diffusers(sd, tiny_sd_path, tmp_path):
    """Prompts are encoded with the request's text-encoder adapters (cached per adapter set); the same prompt
    without them keeps its plain encoding in the same batch."""
    engine, files = sd
    file = build_tiny_lora(tiny_sd_path, tmp_path / "te.safetensors", seed=9, rank=4, std=0.3, text_encoder=True)
    info = engine.executor.adapters().load("te", file)
    assert info.text_encoder
    p = params(40, (("te", 0.9),))
    got = engine.generate([p])[0]
    want = diffusers_sd(tiny_sd_path, {"te": file}, p, (("te", 0.9),))
    assert np.abs(pixels(got.image) - want).max() <= 1
    plain, again = engine.generate([params(40, ()), p])  # one batch: the plain prompt is not the adapted one
    assert np.abs(pixels(again.image) - want).max() <= 1
    assert np.abs(pixels(plain.image) - pixels(engine.generate([params(40, ())])[0].image)).max() <= 1
    engine.executor.adapters().delete("te")


def test_reloading_a_name_serves_the_new_file_alone_and_mixed(sd, tiny_sd_path, tmp_path):
    """Deleted and loaded again under the same name (another file): alone and in a mixed batch the request gets
    the new adapter (the per-layer stacks and the prompt caches follow); a text-encoder adapter loads again too."""
    engine, _ = sd
    store = engine.executor.adapters()
    first = build_tiny_lora(tiny_sd_path, tmp_path / "v1.safetensors", seed=21, rank=4, std=0.3, text_encoder=True)
    second = build_tiny_lora(tiny_sd_path, tmp_path / "v2.safetensors", seed=22, rank=4, std=0.3, text_encoder=True)
    store.load("swap", first)
    mixed = [params(50, (("swap", 1.0),)), params(51, (("a", 1.0),)), params(52, (("b", 0.5),))]
    engine.generate(mixed)  # builds the stacks and caches with the first file
    store.delete("swap")
    store.load("swap", second)
    alone = engine.generate([mixed[0]])[0]
    together = engine.generate(mixed)[0]
    want = diffusers_sd(tiny_sd_path, {"swap": second}, mixed[0], (("swap", 1.0),))
    assert np.abs(pixels(alone.image) - want).max() <= 1
    assert np.abs(pixels(together.image) - want).max() <= 1
    store.delete("swap")


def test_a_request_whose_adapter_was_unloaded_fails_alone(sd):
    """Unloaded between its admission and its step (a bug elsewhere would be the only way): it fails with an
    error naming the adapter, its batch-mates complete."""
    engine, files = sd
    core = engine.core
    from stepserve.request.validation import resolve_params

    store = engine.executor.adapters()
    store.load("brief", files["a"])
    doomed = core.add_request(resolve_params(params(60, (("brief", 1.0),)), engine.model_info), 0.0)
    fine = core.add_request(resolve_params(params(61, (("a", 1.0),)), engine.model_info), 0.0)
    store.delete("brief")
    while not (doomed.is_finished and fine.is_finished):
        core.step(0.0)
    assert doomed.status.value == "failed" and "brief" in doomed.error
    assert fine.status.value == "completed"
