"""A whole SD checkpoint in one file (`--model FILE.safetensors --config DIR`), in the original (LDM) key layout
that `stepserve tiny single-file --whole` writes: served images equal diffusers' StableDiffusionPipeline
`from_single_file` with the same config folder, alone and in mixed batches under every strategy."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.pipelines.weights import Weights
from stepserve.scheduling import STRATEGIES

from served_equal import assert_served_equal

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    from stepserve.cli import main as stepserve_main
    from tiny_sd import build_tiny_sd

    root = tmp_path_factory.mktemp("whole_file")
    folder = build_tiny_sd(root / "sd", seed=5)
    file = root / "sd-whole.safetensors"
    assert stepserve_main(["tiny", "single-file", "--whole", "--model", str(folder), "--out", str(file)]) == 0
    return folder, file


def requests():
    return [SamplingParams(prompt=f"a cat {i}", seed=60 + i, num_inference_steps=[3, 5, 4][i % 3],
                           guidance_scale=[7.5, 1.0][i % 2], sampler=["ddim", "euler"][i % 2],
                           height=(16, 24)[i % 2], width=16) for i in range(6)]


@pytest.fixture(scope="module")
def references(whole):
    import diffusers

    folder, file = whole
    pipe = diffusers.StableDiffusionPipeline.from_single_file(str(file), config=str(folder), local_files_only=True,
                                                             safety_checker=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    config = pipe.scheduler.config
    out = []
    for p in requests():
        pipe.scheduler = (diffusers.DDIMScheduler if p.sampler == "ddim" else diffusers.EulerDiscreteScheduler
                          ).from_config(config)
        image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                     guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                     output_type="np").images[0]
        out.append((image * 255).round().astype(np.int16))
    return out


_EXECUTOR: dict = {}


def executor(folder, file):
    from stepserve.engine.loading import load_executor

    if "x" not in _EXECUTOR:
        _EXECUTOR["x"] = load_executor(str(folder), weights=Weights(checkpoint=str(file)))
    return _EXECUTOR["x"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_whole_file_serves_what_diffusers_makes_of_it(whole, references, strategy):
    folder, file = whole
    params = requests()
    engine = Engine(executor(folder, file), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    results = engine.generate(params)
    assert_served_equal(results, params, references, strategy, "")


def test_the_model_is_named_after_the_file_and_its_weights_are_the_files(whole):
    """The folder's own weights are not what serve: the file's are (here the same numbers, so compare tensors
    through the loaded objects: every UNet weight equals the folder's, by a path that never read the folder's)."""
    folder, file = whole
    pipeline = executor(folder, file).pipeline
    assert pipeline.info.name == "sd-whole"
    from diffusers import UNet2DConditionModel

    own = UNet2DConditionModel.from_pretrained(folder, subfolder="unet").state_dict()
    served = pipeline.networks.unet.state_dict()
    assert set(own) == set(served) and all(torch.equal(own[k], served[k]) for k in own)


def test_flags_and_errors(whole, tmp_path):
    from stepserve.commands.flags import model_of, weights_from_args
    from stepserve.commands.serve import build_parser
    from stepserve.engine.loading import load_executor

    folder, file = whole
    args = build_parser().parse_args(["--model", str(file), "--config", str(folder)])
    assert (model_of(args), weights_from_args(args).checkpoint) == (str(folder), str(file))
    with pytest.raises(ValueError, match="is one file: add --config DIR"):
        weights_from_args(build_parser().parse_args(["--model", str(file)]))
    with pytest.raises(ValueError, match="goes with --model FILE.safetensors"):
        weights_from_args(build_parser().parse_args(["--model", str(folder), "--config", str(folder)]))
    with pytest.raises(FileNotFoundError, match="is not a file"):
        load_executor(str(folder), weights=Weights(checkpoint=str(tmp_path / "none.safetensors")))
    flux_file = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"double_blocks.0.img_attn.qkv.weight": torch.zeros(3, 3)}, str(flux_file))
    with pytest.raises(ValueError, match=f"model: {flux_file} is not a StableDiffusionPipeline checkpoint"):
        load_executor(str(folder), weights=Weights(checkpoint=str(flux_file)))
