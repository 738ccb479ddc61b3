"""`--offload model|group`: the networks held in CPU memory with diffusers' and accelerate's hooks moving them to the
device as they run. On the CPU the hooks move nothing, so these tests check what the CPU can show: the hooks are in
place on the right networks, each network's hook sends the others back before it runs, the batched calls go through
the hooks unchanged (served images equal diffusers' pipeline with the same offloading, mixed batches, every
strategy), and the flag refuses a device with nowhere to move the weights. What offloading costs on a GPU is
`scripts/gpu_check.sh`'s `--offload` rows."""

import numpy as np
import pytest
import torch

from stepserve import Engine, SamplingParams
from stepserve.pipelines.offload import Offload
from stepserve.pipelines.weights import Weights
from stepserve.scheduling import STRATEGIES

from served_equal import assert_served_equal

pytestmark = pytest.mark.usefixtures("batching_pays")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tiny_sd import build_tiny_sd

    return build_tiny_sd(tmp_path_factory.mktemp("offload") / "sd", seed=5)


def requests():
    return [SamplingParams(prompt=f"a boat {i}", seed=70 + i, num_inference_steps=[3, 5, 4][i % 3],
                           guidance_scale=[7.5, 1.0][i % 2], sampler="ddim", height=(16, 24)[i % 2], width=16)
            for i in range(6)]


@pytest.fixture(scope="module")
def references(folder):
    """diffusers' own pipeline, offloaded the same way (on the CPU, as the only device here)."""
    from diffusers import StableDiffusionPipeline

    out = {}
    for mode in ("model", "group"):
        pipe = StableDiffusionPipeline.from_pretrained(folder, safety_checker=None)
        pipe.set_progress_bar_config(disable=True)
        if mode == "model":
            pipe.enable_model_cpu_offload(device="cpu")
        else:
            pipe.unet.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level",
                                           num_blocks_per_group=1)
        images = []
        for p in requests():
            image = pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                         guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                         output_type="np").images[0]
            images.append((image * 255).round().astype(np.int16))
        out[mode] = images
    return out


_EXECUTORS: dict = {}


def executor(folder, mode):
    """The adapter loaded with --offload MODE onto the CPU (load_executor refuses that pair, rightly, for users)."""
    from stepserve.executor.torch_executor import TorchExecutor
    from stepserve.pipelines.registry import load_family_adapter

    if mode not in _EXECUTORS:
        _EXECUTORS[mode] = TorchExecutor(load_family_adapter(str(folder), device="cpu",
                                                             weights=Weights(offload=mode)))
    return _EXECUTORS[mode]


@pytest.mark.parametrize("mode", ["model", "group"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offloaded_networks_serve_what_diffusers_makes_with_the_same_hooks(folder, references, mode, strategy):
    params = requests()
    engine = Engine(executor(folder, mode), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1)
    results = engine.generate(params)
    assert_served_equal(results, params, references[mode], strategy, mode)


def test_the_hooks_sit_on_the_networks_each_mode_names(folder):
    model = executor(folder, "model").pipeline.networks
    for network in (model.text_encoder, model.unet, model.vae):
        assert type(network._hf_hook).__name__ == "OneAtATime", type(network)
    group = executor(folder, "group").pipeline.networks
    assert not hasattr(group.unet, "_hf_hook") and hasattr(group.unet, "_diffusers_hook")
    blocks = [m for m in group.unet.down_blocks.modules() if hasattr(m, "_diffusers_hook")]
    assert blocks, "the denoiser's blocks carry no group-offloading hook"
    for network in (group.text_encoder, group.vae):
        assert type(network._hf_hook).__name__ == "OneAtATime", type(network)


def test_a_network_about_to_run_sends_the_one_on_the_device_back():
    """The device here is torch's "meta" (shapes without data), the only second device a CPU machine has: a network
    that ran is there until another one runs, and then only it goes back to the CPU."""
    offload = Offload("model", "meta")
    nets = [offload.place(torch.nn.Linear(4, 4)) for _ in range(3)]
    sent_back = []

    def back(module):
        sent_back.append(nets.index(module))
        return module.to_empty(device="cpu")

    for net in nets:
        net._hf_hook.init_hook = back
    x = torch.zeros(1, 4, device="meta")
    nets[1](x)
    assert sent_back == [] and nets[1].weight.device.type == "meta"
    nets[0](x)
    assert sent_back == [1] and nets[0].weight.device.type == "meta" and nets[1].weight.device.type == "cpu"
    nets[0](x)  # the one on the device runs again: nothing moves
    assert sent_back == [1]
    nets[2](x)
    assert sent_back == [1, 0] and nets[2].weight.device.type == "meta"


def test_without_offload_the_networks_move_to_the_device_with_no_hooks():
    net = Offload(None, "cpu").place(torch.nn.Linear(4, 4))
    assert not hasattr(net, "_hf_hook") and not hasattr(net, "_diffusers_hook")


def test_offload_needs_an_accelerator_and_a_known_mode(folder):
    from stepserve.engine.loading import load_executor

    with pytest.raises(ValueError, match="--offload group holds weights in CPU memory .* --device cpu has nowhere"):
        load_executor(str(folder), weights=Weights(offload="group"))
    with pytest.raises(ValueError, match="--offload: 'disk' is not a mode; allowed: model, group"):
        Weights(offload="disk")


def test_the_cli_takes_offload_into_the_weights(folder):
    import argparse

    from stepserve.commands.flags import weights_from_args

    args = argparse.Namespace(model=str(folder), offload="model", quantize=None, quantize_text=False,
                              transformer=None, unet=None, config=None)
    assert weights_from_args(args) == Weights(offload="model")


@pytest.mark.parametrize("strategy", ["continuous", "slo"])
def test_a_transformer_offloaded_by_group_serves_what_diffusers_makes(tmp_path_factory, strategy):
    """Flux's transformer, block by block, in mixed batches."""
    from diffusers import FluxPipeline
    from stepserve.executor.torch_executor import TorchExecutor
    from stepserve.pipelines.registry import load_family_adapter
    from stepserve.tiny.flux import build_tiny_flux

    folder = build_tiny_flux(tmp_path_factory.mktemp("offload_flux") / "flux", variant="dev")
    params = [SamplingParams(prompt=f"a lighthouse {i}", seed=300 + 7 * i, num_inference_steps=[2, 4, 3][i % 3],
                             guidance_scale=3.5, height=(32, 48)[i % 2], width=32) for i in range(4)]
    pipe = FluxPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level",
                                          num_blocks_per_group=1)
    references = [(pipe(p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
                        guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                        output_type="np").images[0] * 255).round().astype(np.int16) for p in params]
    adapter = load_family_adapter(str(folder), device="cpu", weights=Weights(offload="group"))
    assert hasattr(adapter.networks.transformer, "_diffusers_hook")
    results = Engine(TorchExecutor(adapter), strategy=strategy, max_batch_size=4, max_queue_delay_ms=1).generate(params)
    assert_served_equal(results, params, references, strategy, "flux")
