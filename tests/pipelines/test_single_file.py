"""A denoiser from one file (`--transformer FILE`): a .safetensors and GGUF files (Q8_0, and the K-quant Q6_K)
written by `stepserve tiny single-file` from a tiny Flux folder. Served images equal diffusers' FluxPipeline with
the transformer loaded the same way (`from_single_file`, with `GGUFQuantizationConfig` for GGUF), alone and in
mixed batches under every strategy; bad files fail with errors that name them."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.pipelines.weights import Weights
from stepserve.scheduling import STRATEGIES

from served_equal import assert_served_equal

pytestmark = pytest.mark.usefixtures("batching_pays")

KINDS = {"safetensors": ("transformer.safetensors", None), "q8_0": ("transformer-q8_0.gguf", "Q8_0"),
         "q6_k": ("transformer-q6_k.gguf", "Q6_K")}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny Flux dev folder 256 wide inside (Q6_K quantizes rows of 256), and its transformer as files."""
    from stepserve.tiny.flux import build_tiny_flux
    from stepserve.tiny.single_file import write_denoiser_file

    root = tmp_path_factory.mktemp("single_file")
    folder = build_tiny_flux(root / "pipe", variant="dev", heads=16)
    files = {kind: write_denoiser_file(folder, "transformer", root / name, quant)
             for kind, (name, quant) in KINDS.items()}
    return folder, files


def requests():
    return [SamplingParams(prompt=f"a lighthouse {i}", seed=300 + 7 * i, num_inference_steps=[2, 4, 3][i % 3],
                           guidance_scale=[3.5, 1.0][i % 2], height=(32, 48)[i % 2], width=32) for i in range(6)]


_PIPES: dict = {}


def reference_pipe(folder, file):
    from diffusers import FluxPipeline, FluxTransformer2DModel, GGUFQuantizationConfig

    if str(file) not in _PIPES:
        options = {"config": str(folder), "subfolder": "transformer", "local_files_only": True,
                   "torch_dtype": torch.float32}
        if str(file).endswith(".gguf"):
            options["quantization_config"] = GGUFQuantizationConfig(compute_dtype=torch.float32)
        transformer = FluxTransformer2DModel.from_single_file(str(file), **options)
        pipe = FluxPipeline.from_pretrained(folder, transformer=transformer, torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        _PIPES[str(file)] = pipe
    return _PIPES[str(file)]


def reference_image(folder, file, p: SamplingParams) -> np.ndarray:
    pipe = reference_pipe(folder, file)
    image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                 guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                 output_type="np").images[0]
    return (image * 255).round().astype(np.int16)


_EXECUTORS: dict = {}


def executor(folder, file):
    from stepserve.engine.loading import load_executor

    if str(file) not in _EXECUTORS:
        _EXECUTORS[str(file)] = load_executor(str(folder), weights=Weights(denoiser=str(file), part="transformer"))
    return _EXECUTORS[str(file)]


@pytest.fixture(scope="module")
def references(flux):
    folder, files = flux
    return {kind: [reference_image(folder, files[kind], p) for p in requests()] for kind in KINDS}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_transformer_file_serves_what_diffusers_makes_of_it(flux, references, kind, strategy):
    folder, files = flux
    params = requests()
    engine = Engine(executor(folder, files[kind]), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    results = engine.generate(params)
    assert_served_equal(results, params, references[kind], strategy, kind)


def test_gguf_weights_stay_quantized_and_change_the_image(flux, references):
    """The served transformer holds GGUF parameters (not weights dequantized once at load), and a Q6_K image is
    not the full-precision one: the file was used."""
    from diffusers.quantizers.gguf.utils import GGUFParameter

    folder, files = flux
    transformer = executor(folder, files["q6_k"]).pipeline.networks.transformer
    quantized = [p for p in transformer.parameters() if isinstance(p, GGUFParameter)]
    assert quantized and all(p.quant_type.name == "Q6_K" for p in quantized)
    assert any(np.abs(a - b).max() > 1 for a, b in zip(references["q6_k"], references["safetensors"]))


def test_the_safetensors_file_serves_the_folders_own_image(flux, references):
    """The file holds the folder's own weights, so its images are the folder's."""
    folder, _ = flux
    from stepserve.engine.loading import load_executor

    results = Engine(load_executor(str(folder)), strategy="continuous", max_batch_size=4).generate(requests())
    for r, ref in zip(results, references["safetensors"]):
        assert np.abs(np.asarray(r.image.convert("RGB"), dtype=np.int16) - ref).max() <= 1


def test_bad_files_are_refused_by_name(flux, tmp_path):
    from stepserve.engine.loading import load_executor

    folder, files = flux
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(FileNotFoundError, match="--transformer: .*nope.safetensors is not a file"):
        load_executor(str(folder), weights=Weights(denoiser=str(missing)))
    text = tmp_path / "model.bin"
    text.write_bytes(b"not weights")
    with pytest.raises(ValueError, match="neither a .safetensors nor a .gguf"):
        load_executor(str(folder), weights=Weights(denoiser=str(text)))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=f"--transformer: {garbage} is not a FluxTransformer2DModel"):
        load_executor(str(folder), weights=Weights(denoiser=str(garbage)))
    with pytest.raises(ValueError, match="this model has no unet; this model's denoiser is its transformer"):
        load_executor(str(folder), weights=Weights(denoiser=str(files["safetensors"]), part="unet"))


def test_a_file_of_another_model_is_refused_by_name(flux, tmp_path):
    """A Flux transformer file given to a narrower Flux folder: the shapes do not match the folder's config."""
    from stepserve.engine.loading import load_executor
    from stepserve.tiny.flux import build_tiny_flux

    _, files = flux
    narrow = build_tiny_flux(tmp_path / "narrow", variant="dev", heads=2)
    with pytest.raises(ValueError, match="is not a FluxTransformer2DModel of the shape that"):
        load_executor(str(narrow), weights=Weights(denoiser=str(files["safetensors"])))
