"""Batched entry points: one call steps every row of a mixed batch.

Rows are grouped by ``Schedule.kind`` (sampler plus the options that change its formula); each group is stepped by
its sampler's flat function with per-row scalars, and the results are scattered back in row order. The caller owns
the progress counters and passes each row's 0-based step index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from . import ddim, dpmpp, euler, flow
from .common import gather_b, to_device
from .schedules import SamplerState

_Fn = Callable[[Tensor, Tensor, Sequence[SamplerState], Sequence[int]], Tensor]

_STEP: dict[str, _Fn] = {
    "ddim": ddim.step,
    "euler": euler.step,
    "euler_a": euler.step_ancestral,
    "dpmpp_2m": dpmpp.step,
    "flow_euler": flow.step,
}

_DENOISED: dict[str, _Fn] = {
    "ddim": ddim.denoised,
    "euler": euler.denoised,
    "euler_a": euler.denoised,
    "dpmpp_2m": dpmpp.denoised,
    "flow_euler": flow.denoised,
}


def _check(latents: Tensor, states: Sequence[SamplerState], steps: Sequence[int]) -> list[int]:
    if latents.ndim < 1 or not (latents.shape[0] == len(states) == len(steps)):
        raise ValueError(
            f"latents, states and steps must describe the same rows: got batch {tuple(latents.shape[:1])}, "
            f"{len(states)} states, {len(steps)} steps"
        )
    out = []
    for st, i in zip(states, steps):
        i = int(i)
        n = st.schedule.num_steps
        if not 0 <= i < n:
            raise ValueError(f"steps must be in range(0, {n}) for this {st.schedule.sampler!r} schedule; got {i}")
        out.append(i)
    return out


def _groups(states: Sequence[SamplerState]) -> list[list[int]]:
    groups: dict[tuple, list[int]] = {}
    for k, st in enumerate(states):
        groups.setdefault(st.schedule.kind, []).append(k)
    return list(groups.values())


def _apply(fns: dict[str, _Fn], model_output: Tensor, latents: Tensor, states, steps) -> Tensor:
    idx_steps = _check(latents, states, steps)
    if model_output.shape != latents.shape:
        raise ValueError(f"model_output shape {tuple(model_output.shape)} != latents {tuple(latents.shape)}")
    groups = _groups(states)
    if len(groups) == 1:
        fn = fns[states[0].schedule.sampler]
        return fn(model_output, latents, list(states), idx_steps).to(latents.dtype)
    out = torch.empty_like(latents)
    for rows in groups:
        index = to_device(torch.tensor(rows), latents.device)
        fn = fns[states[rows[0]].schedule.sampler]
        sub = fn(model_output[index], latents[index], [states[k] for k in rows], [idx_steps[k] for k in rows])
        out[index] = sub.to(latents.dtype)
    return out


def model_inputs(latents: Tensor, states: Sequence[SamplerState], steps: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(denoiser input, per-row timesteps of shape (B,) as float32).

    Euler-family rows are divided by sqrt(sigma^2 + 1) (the EDM c_in for variance-preserving models, Karras et al.
    2022 Table 1); every other row passes through unchanged.
    """
    idx_steps = _check(latents, states, steps)
    timesteps = to_device(
        torch.tensor([st.schedule.timesteps[i] for st, i in zip(states, idx_steps)], dtype=torch.float32),
        latents.device,
    )
    if not any(st.schedule.input_scaling for st in states):
        return latents, timesteps
    sigma = gather_b(
        [st.schedule.sigmas[i] if st.schedule.input_scaling else 0.0 for st, i in zip(states, idx_steps)], latents
    )
    return (latents / ((sigma**2 + 1) ** 0.5)).to(latents.dtype), timesteps


def sampler_step(
    model_output: Tensor, latents: Tensor, states: Sequence[SamplerState], steps: Sequence[int]
) -> Tensor:
    """One denoising step for every row; row k is at step ``steps[k]`` of its own schedule.

    Returns the new latents in ``latents.dtype``. Updates per-request history (dpmpp_2m) and advances per-request
    generators (euler_a, stochastic flow_euler); keeps no step counter.
    """
    return _apply(_STEP, model_output, latents, states, steps)


def predicted_original(
    model_output: Tensor, latents: Tensor, states: Sequence[SamplerState], steps: Sequence[int]
) -> Tensor:
    """The x0 estimate each row's sampler would use at this step (for previews). Touches no state."""
    return _apply(_DENOISED, model_output, latents, states, steps)
