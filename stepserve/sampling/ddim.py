"""Deterministic DDIM (Song et al. 2020, "Denoising Diffusion Implicit Models", eq. 12 with eta = 0).

    x_prev = sqrt(a_prev) * x0_hat + sqrt(1 - a_prev) * eps_hat

where a = alpha-bar at the current timestep, a_prev = alpha-bar at the timestep DDIM steps to, and (x0_hat,
eps_hat) are recovered from the model output according to its parameterisation. All rows of a call share one
``Schedule.kind``; their scalars come from their own tables.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .common import dynamic_threshold, gather_b


def _split(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(x0_hat, eps_hat) for every row, after clipping / thresholding of x0_hat."""
    sch = states[0].schedule
    a = gather_b([st.schedule.alphas_cumprod[i] for st, i in zip(states, steps)], x)
    b = 1 - a
    pred = sch.prediction_type
    if pred == "epsilon":
        x0 = (x - b**0.5 * model_output) / a**0.5
        eps = model_output
    elif pred == "sample":
        x0 = model_output
        eps = (x - a**0.5 * x0) / b**0.5
    elif pred == "v_prediction":
        # v = sqrt(a) * eps - sqrt(1 - a) * x0 (Salimans & Ho 2022)
        x0 = a**0.5 * x - b**0.5 * model_output
        eps = a**0.5 * model_output + b**0.5 * x
    else:  # build_schedule rejects anything else
        raise ValueError(f"prediction_type must be one of ('epsilon', 'sample', 'v_prediction'); got {pred!r}")
    if sch.thresholding is not None:
        x0 = dynamic_threshold(x0, *sch.thresholding)
    elif sch.clip_sample_range is not None:
        x0 = x0.clamp(-sch.clip_sample_range, sch.clip_sample_range)
    return x0, eps


def step(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    x0, eps = _split(model_output, x, states, steps)
    a_prev = gather_b([st.schedule.alphas_cumprod_prev[i] for st, i in zip(states, steps)], x)
    return a_prev**0.5 * x0 + (1 - a_prev) ** 0.5 * eps


def denoised(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    return _split(model_output, x, states, steps)[0]
