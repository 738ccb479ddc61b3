"""Euler and ancestral Euler in the sigma parameterisation (Karras et al. 2022, "Elucidating the Design Space of
Diffusion-Based Generative Models", Alg. 1 / Alg. 2 with S_churn = 0).

The ODE is dx/dsigma = (x - D(x; sigma)) / sigma, where D is the denoiser (x0 estimate). One Euler step:

    x_next = x + (x - D) / sigma * (sigma_next - sigma)

The ancestral variant splits the move to sigma_next into a deterministic step down to sigma_down followed by fresh
noise of size sigma_up, with sigma_down^2 + sigma_up^2 = sigma_next^2 (the k-diffusion "eta = 1" split).

Arithmetic runs in float32 (the sample is upcast first) and the result is cast back by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .common import gather_b, per_item_noise


def _sigmas(x: Tensor, states: Sequence, steps: Sequence[int], offset: int) -> Tensor:
    return gather_b([st.schedule.sigmas[i + offset] for st, i in zip(states, steps)], x)


def _x0(model_output: Tensor, x: Tensor, sigma: Tensor, prediction_type: str) -> Tensor:
    """Denoiser output D(x; sigma) from the network's parameterisation (x is the unscaled latent)."""
    if prediction_type == "epsilon":
        return x - sigma * model_output
    if prediction_type == "v_prediction":
        # v-prediction in the EDM form: D = c_skip * x + c_out * F with c_skip = 1 / (sigma^2 + 1),
        # c_out = -sigma / sqrt(sigma^2 + 1)
        return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + (x / (sigma**2 + 1))
    if prediction_type == "sample":
        return model_output
    raise ValueError(f"prediction_type must be one of ('epsilon', 'v_prediction', 'sample'); got {prediction_type!r}")


def step(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    x = x.to(torch.float32)
    sigma = _sigmas(x, states, steps, 0)
    sigma_next = _sigmas(x, states, steps, 1)
    x0 = _x0(model_output, x, sigma, states[0].schedule.prediction_type)
    d = (x - x0) / sigma
    return x + d * (sigma_next - sigma)


def step_ancestral(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    x = x.to(torch.float32)
    sigma = _sigmas(x, states, steps, 0)
    sigma_next = _sigmas(x, states, steps, 1)
    x0 = _x0(model_output, x, sigma, states[0].schedule.prediction_type)
    sigma_up = (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5
    sigma_down = (sigma_next**2 - sigma_up**2) ** 0.5
    d = (x - x0) / sigma
    x = x + d * (sigma_down - sigma)
    # Noise is drawn at every step (also the last, where sigma_up = 0) so each generator advances exactly as it
    # does in a one-image pipeline.
    noise = per_item_noise(states, x, model_output.dtype)
    return x + noise * sigma_up


def denoised(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    x = x.to(torch.float32)
    return _x0(model_output, x, _sigmas(x, states, steps, 0), states[0].schedule.prediction_type)
