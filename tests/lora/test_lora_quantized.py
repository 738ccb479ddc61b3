"""LoRA per request over a quantized base (tiny Flux dev): a GGUF Q8_0 transformer file and `--quantize int8wo`.
A request with an adapter equals diffusers' FluxPipeline on the same quantized base after load_lora_weights
(uint8 within 1); in a mixed batch each row is the image it gets alone."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.pipelines.weights import Weights
from stepserve.tiny.lora import build_tiny_lora

from extras import require
from lora_reference import pixels

pytestmark = pytest.mark.usefixtures("batching_pays")
BASES = ["gguf-q8_0", "int8wo"]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    require("peft", "lora")
    from stepserve.tiny.flux import build_tiny_flux
    from stepserve.tiny.single_file import write_denoiser_file

    root = tmp_path_factory.mktemp("lora_quantized")
    folder = build_tiny_flux(root / "pipe", variant="dev")
    gguf = write_denoiser_file(folder, "transformer", root / "transformer-q8_0.gguf", "Q8_0")
    lora = build_tiny_lora(folder, root / "p.safetensors", seed=1, rank=4, std=0.3)
    return folder, gguf, lora


def weights_of(base, gguf):
    return Weights(denoiser=str(gguf)) if base.startswith("gguf") else Weights(quantize="int8wo")


def reference(folder, gguf, lora, base, p):
    from diffusers import FluxPipeline, FluxTransformer2DModel, GGUFQuantizationConfig, TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    if base.startswith("gguf"):
        transformer = FluxTransformer2DModel.from_single_file(
            str(gguf), config=str(folder), subfolder="transformer", local_files_only=True,
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32)
    else:
        transformer = FluxTransformer2DModel.from_pretrained(
            folder, subfolder="transformer", quantization_config=TorchAoConfig(Int8WeightOnlyConfig()),
            torch_dtype=torch.float32)
    pipe = FluxPipeline.from_pretrained(folder, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora), adapter_name="p")
    pipe.set_adapters(["p"], [p.loras[0]["scale"]])
    image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


def params(i, scale=None):
    return SamplingParams(prompt=f"a red cube {i}", seed=90 + i, num_inference_steps=4, guidance_scale=3.5,
                          height=32, width=32, loras=[] if scale is None else [{"name": "p", "scale": scale}])


@pytest.mark.parametrize("base", BASES)
def test_an_adapter_over_a_quantized_base_equals_diffusers(flux, base):
    from stepserve.engine.loading import load_executor

    folder, gguf, lora = flux
    engine = Engine(load_executor(str(folder), weights=weights_of(base, gguf)), strategy="continuous",
                    max_batch_size=8)
    engine.executor.adapters().load("p", lora)
    p = params(0, 0.8)
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert np.abs(pixels(got.image) - reference(folder, gguf, lora, base, p)).max() <= 1
    plain = engine.generate([params(0)])[0]
    assert np.abs(pixels(got.image) - pixels(plain.image)).max() > 4, "the adapter changed nothing"
    mixed = [params(10 + i, [None, 1.0, 0.5][i % 3]) for i in range(6)]
    alone = [engine.generate([q])[0] for q in mixed]
    together = engine.generate(mixed)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    for a, b in zip(alone, together):
        assert np.abs(pixels(a.image) - pixels(b.image)).max() <= 1
