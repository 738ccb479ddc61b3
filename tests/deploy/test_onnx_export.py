"""`stepserve export onnx` and the onnxruntime backend: the graphs equal torch, rows do not depend on their batch,
and images served on onnxruntime equal torch's under every strategy."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from stepserve.api import Engine
from stepserve.engine.loading import load_executor
from stepserve.scheduling import STRATEGIES
from stepserve.request.types import SamplingParams

pytestmark = pytest.mark.usefixtures("batching_pays")  # requests must share batches (see conftest)

BATCHES = (1, 3, 8)


@pytest.fixture(scope="module")
def embedded_torch():
    from stepserve.pipelines.diffusers_sd import StableDiffusionAdapter

    return StableDiffusionAdapter.from_pretrained("embedded")


def test_the_manifest_states_dynamic_batch_axes_and_the_check_at_batch_1_3_8(embedded_onnx):
    manifest = json.loads((embedded_onnx / "manifest.json").read_text())
    assert manifest["format"] == "stepserve-onnx" and manifest["opset"] == 17
    assert manifest["source"]["name"] == "embedded"
    unet = manifest["networks"]["unet"]
    shapes = {i["name"]: i["shape"] for i in unet["inputs"]}
    assert shapes["sample"][0] == shapes["timestep"][0] == shapes["encoder_hidden_states"][0] == "batch"
    assert shapes["sample"][2:] == ["latent_height", "latent_width"]
    for name in ("text_encoder", "unet", "vae_decoder"):
        assert set(manifest["validation"][name]) == {"1", "3", "8"}
        assert max(manifest["validation"][name].values()) <= 1e-3
        assert (embedded_onnx / manifest["networks"][name]["file"]).is_file()
    for rel in ("tokenizer", "scheduler/scheduler_config.json", "unet/config.json", "vae/config.json",
                "stepserve.json", "model_index.json"):
        assert (embedded_onnx / rel).exists(), rel


@pytest.mark.parametrize("batch", BATCHES)
def test_onnxruntime_denoiser_equals_torch_with_mixed_timesteps(embedded_onnx, embedded_torch, batch):
    from stepserve.backends.onnxruntime import OnnxRuntimeNetworks

    ort_nets = OnnxRuntimeNetworks.from_dir(embedded_onnx, threads=1)
    g = torch.Generator().manual_seed(batch)
    sample = torch.randn(batch, 4, 4, 4, generator=g) * 3
    timestep = torch.randperm(1000, generator=g)[:batch].float()  # a different step on every row
    embeds = embedded_torch.encode_prompts([str(i % 10) for i in range(batch)])
    embeds = torch.stack(embeds)
    want = embedded_torch.networks.denoise(sample, timestep, embeds)
    got = ort_nets.denoise(sample, timestep, embeds)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4
    ids = embedded_torch.tokenizer([str(i) for i in range(batch)], padding="max_length", return_tensors="pt",
                                   max_length=embedded_torch.tokenizer.model_max_length).input_ids
    text_want = embedded_torch.networks.encode_text(ids, None)
    assert (ort_nets.encode_text(ids, None) - text_want).abs().max() <= 1e-4
    latents = sample / embedded_torch.vae_scaling_factor
    assert (ort_nets.decode(latents) - embedded_torch.networks.decode(latents)).abs().max() <= 1e-3


def test_a_row_of_a_batch_equals_the_same_row_run_alone(embedded_onnx):
    from stepserve.backends.onnxruntime import OnnxRuntimeNetworks

    nets = OnnxRuntimeNetworks.from_dir(embedded_onnx, threads=1)
    g = torch.Generator().manual_seed(5)
    sample, embeds = torch.randn(8, 4, 4, 4, generator=g), torch.randn(8, 16, 64, generator=g)
    timestep = torch.linspace(1, 999, 8)
    together = nets.denoise(sample, timestep, embeds)
    for i in (0, 3, 7):
        alone = nets.denoise(sample[i : i + 1], timestep[i : i + 1], embeds[i : i + 1])
        assert (together[i : i + 1] - alone).abs().max() <= 1e-5


def _mixed_requests(samplers):
    return [SamplingParams(prompt=str(i % 10), seed=100 + i, num_inference_steps=(3, 6, 9)[i % 3],
                           sampler=samplers[i % len(samplers)], guidance_scale=(1.0, 3.0)[i % 2])
            for i in range(6)]


def _pixels(results):
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return [np.asarray(r.image).astype(int) for r in results]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_images_served_on_onnxruntime_equal_torch_under_every_strategy(embedded_onnx, strategy):
    torch_engine = Engine.from_pretrained("embedded", strategy=strategy, max_batch_size=4, memory_cap=False)
    ort_engine = Engine.from_pretrained(str(embedded_onnx), backend="onnxruntime", strategy=strategy,
                                        max_batch_size=4)
    assert ort_engine.executor.pipeline.backend == "onnxruntime"
    params = _mixed_requests(torch_engine.model_info.samplers)
    want, got = _pixels(torch_engine.generate(params)), _pixels(ort_engine.generate(params))
    for a, b in zip(want, got):
        assert a.shape == b.shape and np.abs(a - b).max() <= 1


def test_a_text_to_image_pipeline_with_guidance_serves_the_same_images(tiny_sd_path, tiny_onnx):
    params = [SamplingParams(prompt=p, seed=s, num_inference_steps=n, guidance_scale=g, negative_prompt="x")
              for p, s, n, g in (("a cat", 1, 4, 5.0), ("a dog", 2, 7, 1.0), ("a cat", 3, 5, 7.5))]
    want = _pixels(Engine.from_pretrained(str(tiny_sd_path), memory_cap=False).generate(params))
    got = _pixels(Engine.from_pretrained(str(tiny_onnx), backend="onnxruntime").generate(params))
    for a, b in zip(want, got):
        assert np.abs(a - b).max() <= 1


def test_a_diffusers_folder_is_exported_once_into_the_cache_and_reused(ort, tiny_sd_path, tmp_path, monkeypatch):
    import stepserve.deploy.onnx_cache as onnx_cache

    with pytest.raises(ValueError, match=r"runs an export folder \(with manifest.json\); .* make one with `stepserve export onnx`"):
        load_executor(str(tiny_sd_path), backend="onnxruntime")  # loading never exports
    monkeypatch.setenv("STEPSERVE_CACHE", str(tmp_path))
    calls = []
    real = onnx_cache.export_onnx
    monkeypatch.setattr(onnx_cache, "export_onnx", lambda *a, **k: calls.append(a) or real(*a, **k))
    first = load_executor(onnx_cache.serving_model(str(tiny_sd_path), "onnxruntime"), backend="onnxruntime")
    second = load_executor(onnx_cache.serving_model(str(tiny_sd_path), "onnxruntime"), backend="onnxruntime")
    assert len(calls) == 1
    assert first.pipeline.backend == second.pipeline.backend == "onnxruntime"
    exports = list((tmp_path / "onnx").iterdir())
    assert len(exports) == 1 and (exports[0] / "manifest.json").is_file()


def test_bad_inputs_get_clear_errors(ort, tmp_path, embedded_onnx):
    from stepserve.backends.onnxruntime import OnnxRuntimeNetworks
    from stepserve.deploy.onnx_export import ExportError, export_onnx

    with pytest.raises(FileNotFoundError, match="neither 'embedded' nor a local diffusers folder"):
        export_onnx(tmp_path / "nothing", tmp_path / "out")
    with pytest.raises(ValueError, match="opset: 9 is not supported; allowed: 14..20"):
        export_onnx("embedded", tmp_path / "out", opset=9)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty and is not an ONNX export"):
        export_onnx("embedded", busy)
    with pytest.raises(FileNotFoundError, match="missing text_encoder.onnx, unet.onnx, vae_decoder.onnx"):
        OnnxRuntimeNetworks.from_dir(tmp_path)
    with pytest.raises(ValueError, match="backend 'onnxruntime' runs on the CPU in float32"):
        load_executor(str(embedded_onnx), dtype="float16", backend="onnxruntime")
    with pytest.raises(ValueError, match="backend: 'tvm' is not supported; allowed: torch, onnxruntime, tensorrt"):
        load_executor("embedded", backend="tvm")


def test_the_export_command_writes_a_folder_and_refuses_a_bad_model(ort, tmp_path, capsys):
    from stepserve.cli import main

    assert main(["export", "onnx", "--model", "embedded", "--out", str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "unet.onnx").is_file()
    printed = capsys.readouterr()
    # the progress lines time the graph phase, counted in plural words; the last line times the command
    phase = re.search(r"export onnx \(export and check 3 graphs\): done 6 steps in ([0-9.]+) s", printed.err)
    whole = re.search(r"wrote .* ([0-9.]+) s after the command started \(loading torch and the model", printed.out)
    assert "export onnx (export and check 3 graphs): started (6 steps)" in printed.err
    assert phase and whole and float(whole.group(1)) >= float(phase.group(1)), printed
    assert main(["export", "onnx", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "y")]) == 2
    assert "neither 'embedded' nor a local diffusers folder" in capsys.readouterr().err
    assert main(["export", "webgpu"]) == 2
    assert "unknown target 'webgpu'; allowed: onnx, tensorrt, triton" in capsys.readouterr().err


def test_every_backend_is_warmed_up_at_start_up(embedded_onnx):
    """One throwaway request through encode, a step and decode before the first real one (onnxruntime's first
    session run is slow); unless turned off, and not on an executor handed in (a fake, or a shared one)."""
    from stepserve.engine.config import EngineConfig, build_engine

    for warm, backend, model in ((True, "onnxruntime", str(embedded_onnx)), (False, "onnxruntime", str(embedded_onnx)),
                                 (True, "torch", "embedded")):
        said: list[str] = []
        built = build_engine(EngineConfig(model=model, backend=backend, warm_up=warm, memory_cap=False), said.append)
        assert any(line.startswith("warm-up: one request through every stage") for line in said) == warm, said
        shared: list[str] = []
        build_engine(EngineConfig(model=model, backend=backend), shared.append, executor=built.executor)
        assert not any(line.startswith("warm-up") for line in shared)
