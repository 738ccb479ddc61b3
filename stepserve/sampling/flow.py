"""Euler for rectified-flow / flow-matching models (Lipman et al. 2022, "Flow Matching for Generative Modeling";
Esser et al. 2024, "Scaling Rectified Flow Transformers", the SD3 sampler).

The model predicts a velocity v along x_sigma = (1 - sigma) * x0 + sigma * noise, so one Euler step is

    x_next = x + (sigma_next - sigma) * v

With stochastic sampling the step instead re-noises the implied data estimate x0 = x - sigma * v:
x_next = (1 - sigma_next) * x0 + sigma_next * noise, the noise drawn from the request's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .common import gather_b, per_item_noise


def _sigma(x: Tensor, states: Sequence, steps: Sequence[int], offset: int) -> Tensor:
    return gather_b([st.schedule.sigmas[i + offset] for st, i in zip(states, steps)], x)


def step(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    x = x.to(torch.float32)
    sigma = _sigma(x, states, steps, 0)
    sigma_next = _sigma(x, states, steps, 1)
    if states[0].schedule.stochastic:
        x0 = x - sigma * model_output
        noise = per_item_noise(states, x, x.dtype)
        return (1.0 - sigma_next) * x0 + sigma_next * noise
    return x + (sigma_next - sigma) * model_output


def denoised(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    x = x.to(torch.float32)
    return x - _sigma(x, states, steps, 0) * model_output
