"""DPM-Solver++(2M): multistep second-order solver in data-prediction form (Lu et al. 2022, "DPM-Solver++: Fast
Solver for Guided Sampling of Diffusion Probabilistic Models", Alg. 2, midpoint variant).

With alpha_t = 1 / sqrt(sigma^2 + 1), sigma_t = sigma * alpha_t and lambda = log(alpha_t / sigma_t):

    h   = lambda_next - lambda_cur,   r = (lambda_cur - lambda_prev) / h
    D0  = x0_cur,                     D1 = (x0_cur - x0_prev) / r
    x_next = (sigma_t,next / sigma_t,cur) * x - alpha_next * (exp(-h) - 1) * (D0 + D1 / 2)

First-order steps (D1 = 0, i.e. DDIM in lambda time) are taken where ``Schedule.orders`` says so. The previous data
prediction lives in each request's ``SamplerState.history``, keyed by step index, so rows of one batch can be at
any step and a failed step can be retried.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .common import dynamic_threshold, gather_b


def _alpha_sigma(sigma: Tensor, flow: bool) -> tuple[Tensor, Tensor]:
    if flow:  # rectified-flow noise levels: x = (1 - sigma) * x0 + sigma * noise
        return 1 - sigma, sigma
    alpha = 1 / ((sigma**2 + 1) ** 0.5)
    return alpha, sigma * alpha


def _x0(model_output: Tensor, x: Tensor, sigma: Tensor, schedule) -> Tensor:
    pred = schedule.prediction_type
    alpha_t, sigma_t = _alpha_sigma(sigma, schedule.flow_sigmas)
    if pred == "epsilon":
        x0 = (x - sigma_t * model_output) / alpha_t
    elif pred == "sample":
        x0 = model_output
    elif pred == "v_prediction":
        x0 = alpha_t * x - sigma_t * model_output
    elif pred == "flow_prediction":
        x0 = x - sigma * model_output
    else:  # build_schedule rejects anything else
        raise ValueError(
            f"prediction_type must be one of ('epsilon', 'sample', 'v_prediction', 'flow_prediction'); got {pred!r}"
        )
    if schedule.thresholding is not None:
        x0 = dynamic_threshold(x0, *schedule.thresholding)
    return x0


def _lambda(alpha: Tensor, sigma: Tensor) -> Tensor:
    return torch.log(alpha) - torch.log(sigma)


def step(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    sch = states[0].schedule
    flow = sch.flow_sigmas
    sig = [st.schedule.sigmas for st in states]
    s_cur = gather_b([s[i] for s, i in zip(sig, steps)], x)
    s_next = gather_b([s[i + 1] for s, i in zip(sig, steps)], x)
    s_prev = gather_b([s[max(i - 1, 0)] for s, i in zip(sig, steps)], x)
    second = [st.schedule.orders[i] == 2 for st, i in zip(states, steps)]

    x0 = _x0(model_output, x, s_cur, sch)  # from the sample as given, before the float32 upcast

    prev = []
    for k, (st, i) in enumerate(zip(states, steps)):
        if second[k]:
            if i - 1 not in st.history:
                raise RuntimeError(
                    f"dpmpp_2m step {i} needs the data prediction of step {i - 1}; steps must be taken in order"
                )
            prev.append(st.history[i - 1])
        else:
            prev.append(x0[k])
    x0_prev = torch.stack(prev).to(device=x0.device)
    for k, (st, i) in enumerate(zip(states, steps)):
        st.history[i] = x0[k]
        for old in [j for j in st.history if j < i - 1 or j > i]:
            del st.history[old]

    x = x.to(torch.float32)
    alpha_n, sigma_n = _alpha_sigma(s_next, flow)
    alpha_c, sigma_c = _alpha_sigma(s_cur, flow)
    alpha_p, sigma_p = _alpha_sigma(s_prev, flow)
    lam_n, lam_c, lam_p = _lambda(alpha_n, sigma_n), _lambda(alpha_c, sigma_c), _lambda(alpha_p, sigma_p)
    h = lam_n - lam_c
    r0 = (lam_c - lam_p) / h
    c = alpha_n * (torch.exp(-h) - 1.0)
    first = (sigma_n / sigma_c) * x - c * x0
    d1 = (1.0 / r0) * (x0 - x0_prev)
    correction = (0.5 * c) * d1
    mask = gather_b([1.0 if s else 0.0 for s in second], x) > 0
    return first - torch.where(mask, correction, torch.zeros_like(correction))


def denoised(model_output: Tensor, x: Tensor, states: Sequence, steps: Sequence[int]) -> Tensor:
    s_cur = gather_b([st.schedule.sigmas[i] for st, i in zip(states, steps)], x)
    return _x0(model_output, x, s_cur, states[0].schedule)
