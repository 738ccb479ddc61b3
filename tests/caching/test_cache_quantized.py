"""Step caching and edits over a quantized denoiser (tiny Flux dev with a GGUF Q8_0 transformer file). A cached
request alone equals diffusers' FluxPipeline on the same GGUF transformer with the same cache hook, skipping the
same steps; in a mixed batch (cached, plain and image-to-image rows) each image is the one it gets alone."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.pipelines.weights import Weights

from edit_images import assert_each_its_own, pixels, start_image
from extras import require

pytestmark = pytest.mark.usefixtures("batching_pays")
FBCACHE = {"policy": "fbcache", "threshold": 0.6}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    require("gguf", "quant")
    from stepserve.tiny.flux import build_tiny_flux
    from stepserve.tiny.single_file import write_denoiser_file

    root = tmp_path_factory.mktemp("cache_quantized")
    folder = build_tiny_flux(root / "pipe", variant="dev")
    return folder, write_denoiser_file(folder, "transformer", root / "transformer-q8_0.gguf", "Q8_0")


@pytest.fixture(scope="module")
def engine(flux):
    folder, gguf = flux
    return Engine.from_pretrained(str(folder), strategy="continuous", max_batch_size=8,
                                  weights=Weights(denoiser=str(gguf)))


def params(i: int, cache=None, **extra) -> SamplingParams:
    return SamplingParams(prompt=f"a quantized lighthouse {i}", seed=500 + i, num_inference_steps=[10, 7, 8][i % 3],
                          height=32, width=32, guidance_scale=3.5, cache=cache, **extra)


def test_a_cached_request_equals_diffusers_hook_on_the_same_gguf_base(flux, engine):
    from diffusers import FirstBlockCacheConfig, FluxPipeline, FluxTransformer2DModel, GGUFQuantizationConfig

    folder, gguf = flux
    transformer = FluxTransformer2DModel.from_single_file(
        str(gguf), config=str(folder), subfolder="transformer", local_files_only=True,
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32)
    pipe = FluxPipeline.from_pretrained(folder, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    ran = []
    transformer.single_transformer_blocks[0].attn.register_forward_hook(lambda *a: ran.append(1))
    transformer.enable_cache(FirstBlockCacheConfig(threshold=0.6))
    p = params(0, FBCACHE)
    want = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                output_type="np").images[0]
    got = engine.generate([p])[0]
    assert got.ok, got.error
    assert 0 < got.timing.cached_steps == p.num_inference_steps - len(ran)
    assert np.abs(pixels(got.image) - (want * 255).round().astype(np.int16)).max() <= 1


def test_cached_plain_and_edit_rows_share_a_quantized_step(engine):
    reqs = [params(i, FBCACHE if i % 3 == 0 else None,
                   **({"image": start_image(i, 32), "strength": 0.6} if i % 3 == 2 else {})) for i in range(6)]
    together = engine.generate(reqs)
    assert max(max(r.timing.batch_sizes) for r in together) > 1
    assert any(r.timing.cached_steps for r in together)
    assert_each_its_own(engine, reqs)
