"""Models larger than the device: weights held in CPU memory and moved to the device when they run (`--offload`).

- `model`: each network (text encoders, denoiser, VAE) moves to the device whole when it runs, and the one that ran
  before it goes back to the CPU: one network on the device at a time (accelerate's `cpu_offload_with_hook`, as
  diffusers' `enable_model_cpu_offload`). The denoiser stays on the device from step to step while no prompt is
  encoded and no image decoded, so with step batching a transfer is paid once per switch, not per request.
- `group`: the denoiser's blocks move one at a time as its forward reaches them (diffusers' block-level
  `apply_group_offloading`, with a CUDA stream that loads the next block while one runs), so the device holds one
  block of it; the other networks move whole as under `model`. Every step pays the transfer of the whole denoiser
  once for the whole batch: a step of 8 rows moves the same bytes as a step of 1.

The families call `Offload.place` where they would call `module.to(device)`. The engine's tensors (latents,
embeddings) are made on the device as always; the hooks move the weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

OFFLOAD_MODES = {"model": "each network moves to the device whole when it runs, one at a time",
                 "group": "the denoiser's blocks move one at a time within each step; the other networks whole"}


def check_offload(mode: str | None, device: str) -> None:
    """Before anything loads: a device to move the weights to (Weights checks the mode)."""
    if mode is not None and str(device).split(":")[0] == "cpu":
        raise ValueError(f"--offload {mode} holds weights in CPU memory and moves them to an accelerator as they "
                         "run; --device cpu has nowhere to move them (use --device cuda, or leave --offload out)")


def _one_at_a_time(owner: "Offload", onload: torch.device):
    """accelerate's CpuOffload hook (the module moves to `onload` as it runs, diffusers' VAE encode/decode call it
    too) that first sends every other network `owner` moves whole back to the CPU."""
    from accelerate.hooks import CpuOffload

    class OneAtATime(CpuOffload):
        def pre_forward(self, module, *args, **kwargs):
            for other in owner.whole:
                if other is not module and next(other.parameters()).device.type != "cpu":
                    other._hf_hook.init_hook(other)  # to the CPU
            return super().pre_forward(module, *args, **kwargs)

    return OneAtATime(execution_device=onload)


class Offload:
    """Places a family's networks for `mode` (OFFLOAD_MODES, or None: on the device, no hooks). `onload`: where they
    run."""

    def __init__(self, mode: str | None, onload: torch.device | str) -> None:
        import torch

        self.mode, self.onload = mode, torch.device(onload)
        self.whole: list[torch.nn.Module] = []  # networks moved whole (each with an accelerate hook, `_hf_hook`)
        self.grouped: list[torch.nn.Module] = []  # networks moved block by block

    def place(self, module: torch.nn.Module, denoiser: bool = False) -> torch.nn.Module:
        """`module` ready to run on the device: moved there, or left in CPU memory with the hooks that move it."""
        import torch

        if self.mode is None:
            return module.to(self.onload)
        module = module.to("cpu")
        if denoiser and self.mode == "group":
            from diffusers.hooks import apply_group_offloading

            apply_group_offloading(module, onload_device=self.onload, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1,
                                   use_stream=self.onload.type == "cuda")
            self.grouped.append(module)
            return module
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(module, _one_at_a_time(self, self.onload), append=True)
        self.whole.append(module)
        return module

    def describe(self) -> dict:
        """What is held how: the class names of the networks moved whole and block by block."""
        return {"mode": self.mode, "whole": [type(m).__name__ for m in self.whole],
                "grouped": [type(m).__name__ for m in self.grouped]}
