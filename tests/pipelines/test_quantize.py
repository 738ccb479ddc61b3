"""`--quantize int8wo` on the CPU: the denoiser quantized as it loads (torchao through diffusers' TorchAoConfig).
Served images equal diffusers' pipeline with the denoiser loaded the same way, alone and in mixed batches under
every strategy, on tiny SD (a UNet) and tiny Flux (a transformer); a type the device cannot run is refused."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.pipelines.weights import Weights
from stepserve.scheduling import STRATEGIES

from served_equal import assert_served_equal

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from stepserve.tiny.flux import build_tiny_flux
    from tiny_sd import build_tiny_sd

    root = tmp_path_factory.mktemp("quantize")
    return {"sd": build_tiny_sd(root / "sd", seed=3), "flux": build_tiny_flux(root / "flux", variant="dev")}


def requests(family):
    if family == "sd":
        return [SamplingParams(prompt=f"a cat {i}", seed=40 + i, num_inference_steps=[3, 5, 4][i % 3],
                               guidance_scale=[7.5, 1.0][i % 2], sampler="ddim", height=(16, 24)[i % 2],
                               width=16) for i in range(6)]
    return [SamplingParams(prompt=f"a lighthouse {i}", seed=300 + 7 * i, num_inference_steps=[2, 4, 3][i % 3],
                           guidance_scale=[3.5, 1.0][i % 2], height=(32, 48)[i % 2], width=32) for i in range(6)]


def reference_pipe(family, folder):
    from diffusers import FluxPipeline, FluxTransformer2DModel, StableDiffusionPipeline, TorchAoConfig
    from diffusers import UNet2DConditionModel
    from torchao.quantization import Int8WeightOnlyConfig

    config = TorchAoConfig(Int8WeightOnlyConfig())
    if family == "sd":
        unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", quantization_config=config,
                                                    torch_dtype=torch.float32)
        pipe = StableDiffusionPipeline.from_pretrained(folder, unet=unet, safety_checker=None)
    else:
        transformer = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer",
                                                             quantization_config=config, torch_dtype=torch.float32)
        pipe = FluxPipeline.from_pretrained(folder, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def references(folders):
    out = {}
    for family, folder in folders.items():
        pipe = reference_pipe(family, folder)
        images = []
        for p in requests(family):
            image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                         guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                         output_type="np").images[0]
            images.append((image * 255).round().astype(np.int16))
        out[family] = images
    return out


_EXECUTORS: dict = {}


def executor(folder):
    from stepserve.engine.loading import load_executor

    if str(folder) not in _EXECUTORS:
        _EXECUTORS[str(folder)] = load_executor(str(folder), weights=Weights(quantize="int8wo"))
    return _EXECUTORS[str(folder)]


@pytest.mark.parametrize("family", ["sd", "flux"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_int8wo_serves_what_diffusers_makes_of_it(folders, references, family, strategy):
    params = requests(family)
    engine = Engine(executor(folders[family]), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    results = engine.generate(params)
    assert_served_equal(results, params, references[family], strategy, family)


def test_the_denoiser_holds_int8_weights(folders):
    networks = executor(folders["flux"]).pipeline.networks
    linear = [m for m in networks.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert linear and all("Int8" in type(m.weight).__name__ for m in linear), {type(m.weight) for m in linear}
    assert not any("Int8" in type(p).__name__ for p in networks.vae.parameters())


@pytest.mark.parametrize("kind", ["float8wo", "int4wo", "nf4"])
def test_a_type_the_cpu_cannot_run_is_refused_before_loading(folders, kind):
    from stepserve.engine.loading import load_executor

    with pytest.raises(ValueError, match=f"--quantize {kind} .* runs on cuda, not --device cpu; on cpu: int8wo, int8dq"):
        load_executor(str(folders["sd"]), weights=Weights(quantize=kind))


def test_an_unknown_type_and_a_gguf_file_are_refused():
    with pytest.raises(ValueError, match="--quantize: 'int3' is not a type; allowed: int8wo, int8dq"):
        Weights(quantize="int3")
    with pytest.raises(ValueError, match="is quantized already"):
        Weights(denoiser="x.gguf", quantize="int8wo")


def test_quantize_text_quantizes_the_text_encoder_as_diffusers_would(folders):
    """--quantize int8wo --quantize-text: the CLIP text encoder holds int8 weights too (transformers' TorchAoConfig),
    and the image equals diffusers' pipeline with both parts loaded that way."""
    from diffusers import StableDiffusionPipeline, TorchAoConfig, UNet2DConditionModel
    from stepserve.engine.loading import load_executor
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import CLIPTextModel
    from transformers import TorchAoConfig as TextConfig

    folder = folders["sd"]
    served = load_executor(str(folder), weights=Weights(quantize="int8wo", quantize_text=True))
    encoder = served.pipeline.networks.text_encoder
    assert any("Int8" in type(m.weight).__name__ for m in encoder.modules() if isinstance(m, torch.nn.Linear))
    unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", torch_dtype=torch.float32,
                                                quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))
    text = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder",
                                         quantization_config=TextConfig(Int8WeightOnlyConfig()))
    pipe = StableDiffusionPipeline.from_pretrained(folder, unet=unet, text_encoder=text, safety_checker=None)
    pipe.set_progress_bar_config(disable=True)
    params = requests("sd")[:3]
    results = Engine(served, strategy="continuous", max_batch_size=4, max_queue_delay_ms=1).generate(params)
    for r, p in zip(results, params):
        want = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                    guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                    output_type="np").images[0]
        diff = np.abs(np.asarray(r.image.convert("RGB"), dtype=np.int16) - (want * 255).round().astype(np.int16))
        assert diff.max() <= 1, (p, diff.max())
    with pytest.raises(ValueError, match="--quantize-text goes with --quantize int8wo"):
        Weights(quantize="nf4", quantize_text=True)
