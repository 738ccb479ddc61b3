"""Starting a request part-way through its schedule (image to image): diffusers' img2img pipelines keep the
schedule of `num_inference_steps` steps, skip its first `t_start` steps (`get_timesteps`: t_start = n -
min(int(n * strength), n), the scheduler's begin_index), and start from the encoded image noised to that step's
level (the scheduler's `add_noise` / `scale_noise`)."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .schedules import Schedule


def starting_at(schedule: Schedule, step: int) -> Schedule:
    """The schedule as a sampler that begins at `step` sees it: DPM-Solver++'s first step is first order (it has no
    history yet), as diffusers' multistep schedulers count their lower-order steps from the begin index."""
    if step == 0 or not schedule.orders:
        return schedule
    orders = list(schedule.orders)
    orders[step] = 1
    return dataclasses.replace(schedule, orders=tuple(orders))


def add_noise(schedule: Schedule, original: Tensor, noise: Tensor, step: int) -> Tensor:
    """`original` noised to the level of `step`, as the sampler's diffusers scheduler adds noise there."""
    dtype = original.dtype
    if schedule.sampler == "ddim":  # DDIMScheduler.add_noise at the step's timestep
        a = torch.tensor(schedule.alphas_cumprod[step], dtype=dtype)
        return a ** 0.5 * original + (1 - a) ** 0.5 * noise
    sigma = torch.tensor(schedule.sigmas[step], dtype=dtype)
    if schedule.sampler in ("euler", "euler_a"):  # EulerDiscreteScheduler.add_noise
        return original + noise * sigma
    if schedule.sampler == "flow_euler" or schedule.flow_sigmas:  # scale_noise / flow sigmas
        return sigma * noise + (1.0 - sigma) * original
    if schedule.sampler == "dpmpp_2m":  # DPMSolverMultistepScheduler.add_noise (_sigma_to_alpha_sigma_t)
        alpha_t = 1 / ((sigma**2 + 1) ** 0.5)
        return alpha_t * original + sigma * alpha_t * noise
    raise ValueError(f"no img2img noise rule for sampler {schedule.sampler!r}")
