"""Per-request sampling schedules, read off the diffusers scheduler that a pipeline would use.

``build_schedule`` instantiates the diffusers scheduler class for the sampler from the pipeline's scheduler config,
calls ``set_timesteps`` and copies the resulting tables (timesteps, sigmas, alphas_cumprod) into a frozen
``Schedule``. That way every option the scheduler honours when it builds its tables -- timestep_spacing,
steps_offset, beta schedules, Karras / exponential / beta sigmas, final_sigmas_type, shift, ... -- is honoured here
too, and the samplers only ever see plain per-step numbers.

Flow models add two per-request inputs (see ``flow_shift``): ``mu``, the resolution-dependent shift of a config with
``use_dynamic_shifting``, and ``sigmas``, what the caller's pipeline passes to ``set_timesteps`` (FluxPipeline
passes ``np.linspace(1, 1/n, n)``; StableDiffusion3Pipeline passes nothing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..request.types import SAMPLER_NAMES
from .flow_shift import SIGMAS_CHOICES, is_flow_config, pipeline_sigmas
from .reference import check_choice as _check_choice
from .reference import reference_scheduler

_PREDICTION_TYPES = {
    "ddim": ("epsilon", "sample", "v_prediction"),
    "euler": ("epsilon", "v_prediction", "sample", "original_sample"),
    "euler_a": ("epsilon", "v_prediction"),
    "dpmpp_2m": ("epsilon", "sample", "v_prediction", "flow_prediction"),
}

_SPACINGS = ("linspace", "leading", "trailing")
_BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")


@dataclass(frozen=True)
class Schedule:
    """Everything one request's sampler needs, as plain numbers. Tables hold float32 values as Python floats."""

    sampler: str
    num_steps: int  # len(timesteps); what the caller must iterate (equals the requested count for these classes)
    timesteps: tuple[float, ...]  # (n,) timestep passed to the denoiser at each step
    init_noise_sigma: float
    prediction_type: str  # "flow" for flow_euler (velocity)
    sigmas: tuple[float, ...] = ()  # (n+1,) noise level at each step boundary (euler, euler_a, dpmpp_2m, flow_euler)
    alphas_cumprod: tuple[float, ...] = ()  # (n,) alpha-bar at each step's timestep (ddim)
    alphas_cumprod_prev: tuple[float, ...] = ()  # (n,) alpha-bar DDIM steps to (ddim)
    input_scaling: bool = False  # model input is x / sqrt(sigma^2 + 1) (euler, euler_a)
    orders: tuple[int, ...] = ()  # (n,) solver order used at each step (dpmpp_2m)
    clip_sample_range: float | None = None  # ddim: clamp x0 to [-r, r]
    thresholding: tuple[float, float] | None = None  # (quantile ratio, max value): dynamic thresholding of x0
    flow_sigmas: bool = False  # dpmpp_2m: alpha_t = 1 - sigma, sigma_t = sigma
    stochastic: bool = False  # flow_euler: stochastic_sampling (re-noise x0 each step)
    mu: float | None = None  # the resolution-dependent shift it was built with (use_dynamic_shifting), else None
    config: tuple = field(default=(), repr=False)  # the (frozen) scheduler config it was built from

    @property
    def kind(self) -> tuple:
        """Rows whose schedules share a kind step with the same formula and can be stepped together."""
        return (
            self.sampler,
            self.prediction_type,
            self.clip_sample_range,
            self.thresholding,
            self.flow_sigmas,
            self.stochastic,
        )


@dataclass(eq=False)
class SamplerState:
    """Per-request mutable state. The step counter is NOT kept here: callers pass the step index each time."""

    schedule: Schedule
    generator: torch.Generator | None = None
    history: dict[int, Any] = field(default_factory=dict)  # dpmpp_2m: step index -> data prediction at that step


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return ("__map__",) + tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy / torch arrays and scalars
        return _freeze(value.tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        if value[:1] == ("__map__",):
            return {k: _thaw(v) for k, v in value[1:]}
        return [_thaw(v) for v in value]
    return value


def build_schedule(
    sampler: str,
    scheduler_config: Mapping[str, Any],
    num_steps: int,
    *,
    mu: float | None = None,
    sigmas: str | None = None,
) -> Schedule:
    """Build (cached) the step tables for one request.

    ``mu``: the request's resolution-dependent shift (``flow_shift_mu``); required exactly when the scheduler uses
    ``use_dynamic_shifting``, refused otherwise. ``sigmas``: what the caller's pipeline passes to ``set_timesteps``
    -- None (the scheduler's own spacing, as StableDiffusion3Pipeline) or "linspace" (FluxPipeline's
    ``np.linspace(1.0, 1 / num_steps, num_steps)``, dropped for a scheduler with use_flow_sigmas as FluxPipeline
    does); "linspace" is only for flow schedules.

    Raises ValueError naming the field and its allowed values for an unknown sampler, a bad step count, a missing or
    unexpected ``mu``, or a config option these samplers do not implement.
    """
    _check_choice("sampler", sampler, SAMPLER_NAMES)
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer (1, 2, 3, ...); got {num_steps!r}")
    if not isinstance(scheduler_config, Mapping):
        raise ValueError(f"scheduler_config must be a mapping; got {type(scheduler_config).__name__}")
    if mu is not None and (isinstance(mu, bool) or not isinstance(mu, (int, float)) or not math.isfinite(mu)):
        raise ValueError(f"mu must be a finite number or None; got {mu!r}")
    _check_choice("sigmas", sigmas, SIGMAS_CHOICES)
    config = dict(scheduler_config)
    train_steps = config.get("num_train_timesteps", 1000)
    if num_steps > train_steps:
        raise ValueError(f"num_steps must be in 1..{train_steps} (num_train_timesteps); got {num_steps}")
    if sampler != "flow_euler" and not is_flow_config(config):
        if config.get("trained_betas") is None and "beta_schedule" in config:
            _check_choice("beta_schedule", config["beta_schedule"], _BETA_SCHEDULES, sampler)
    return _build_cached(sampler, _freeze(config), num_steps, None if mu is None else float(mu), sigmas)


@functools.lru_cache(maxsize=512)
def _build_cached(sampler: str, frozen_config: tuple, num_steps: int, mu: float | None, sigmas: str | None) -> Schedule:
    scheduler = reference_scheduler(sampler, _thaw(frozen_config))
    cfg = scheduler.config
    _validate(sampler, cfg)
    _validate_flow_inputs(sampler, cfg, mu, sigmas)
    kwargs: dict[str, Any] = {} if mu is None else {"mu": mu}
    explicit = None if cfg.get("use_flow_sigmas") else pipeline_sigmas(sigmas, num_steps)
    if explicit is not None:  # as diffusers' retrieve_timesteps passes custom sigmas: without a step count
        scheduler.set_timesteps(sigmas=explicit, device="cpu", **kwargs)
    else:
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
    schedule = dataclasses.replace(_BUILDERS[sampler](scheduler, cfg, frozen_config), mu=mu)
    tables = schedule.timesteps + schedule.sigmas + schedule.alphas_cumprod + schedule.alphas_cumprod_prev
    if not all(math.isfinite(v) for v in tables):
        raise ValueError(f"num_steps={num_steps} gives non-finite {sampler!r} tables with this scheduler config")
    return schedule


def _validate_flow_inputs(sampler: str, cfg: Mapping[str, Any], mu: float | None, sigmas: str | None) -> None:
    flow = sampler == "flow_euler" or bool(cfg.get("use_flow_sigmas"))
    if sigmas is not None and not flow:
        raise ValueError(
            f"sigmas must be one of (None,) for sampler {sampler!r} with this scheduler config: explicit pipeline "
            f"sigmas ({sigmas!r}) apply to flow schedules only"
        )
    dynamic = bool(cfg.get("use_dynamic_shifting"))
    if dynamic and mu is None:
        raise ValueError(
            f"mu is required for sampler {sampler!r}: the scheduler config sets use_dynamic_shifting, so the "
            "schedule depends on the image size; pass mu=flow_shift_mu(image_seq_len, scheduler_config)"
        )
    if not dynamic and mu is not None:
        raise ValueError(
            f"mu must be None for sampler {sampler!r} with this scheduler config (use_dynamic_shifting is off, the "
            f"shift is fixed); got mu={mu!r}"
        )


def _validate(sampler: str, cfg: Mapping[str, Any]) -> None:
    if sampler == "flow_euler":
        _check_choice("time_shift_type", cfg.get("time_shift_type", "exponential"), ("exponential", "linear"), sampler)
        return
    _check_choice("prediction_type", cfg.get("prediction_type"), _PREDICTION_TYPES[sampler], sampler)
    _check_choice("timestep_spacing", cfg.get("timestep_spacing"), _SPACINGS, sampler)
    if sampler == "dpmpp_2m":
        _check_choice("variance_type", cfg.get("variance_type"), (None,), sampler)
        if not cfg.get("use_flow_sigmas"):  # the dynamic shift only moves flow sigmas (flow_shift = exp(mu))
            _check_choice("use_dynamic_shifting", bool(cfg.get("use_dynamic_shifting")), (False,), sampler)
        _check_choice("final_sigmas_type", cfg.get("final_sigmas_type"), ("zero", "sigma_min"), sampler)


def _floats(t: torch.Tensor) -> tuple[float, ...]:
    return tuple(float(v) for v in t.detach().to("cpu", torch.float32).reshape(-1).tolist())


def _thresholding(cfg: Mapping[str, Any]) -> tuple[float, float] | None:
    if not cfg.get("thresholding"):
        return None
    return (float(cfg["dynamic_thresholding_ratio"]), float(cfg["sample_max_value"]))


def _ddim(s, cfg, frozen) -> Schedule:
    # DDIM steps from t to t - T // n (whatever the spacing), landing on final_alpha_cumprod below 0.
    ratio = cfg["num_train_timesteps"] // s.num_inference_steps
    ts = [int(t) for t in s.timesteps.tolist()]
    ac = s.alphas_cumprod
    final = float(torch.as_tensor(s.final_alpha_cumprod, dtype=torch.float32))
    thresholding = _thresholding(cfg)
    clip = float(cfg["clip_sample_range"]) if cfg.get("clip_sample") and thresholding is None else None
    return Schedule(
        sampler="ddim",
        num_steps=len(ts),
        timesteps=tuple(float(t) for t in ts),
        init_noise_sigma=float(s.init_noise_sigma),
        prediction_type=cfg["prediction_type"],
        alphas_cumprod=tuple(float(ac[t]) for t in ts),
        alphas_cumprod_prev=tuple(float(ac[t - ratio]) if t - ratio >= 0 else final for t in ts),
        clip_sample_range=clip,
        thresholding=thresholding,
        config=frozen,
    )


def _euler(s, cfg, frozen, name="euler") -> Schedule:
    pred = cfg["prediction_type"]
    return Schedule(
        sampler=name,
        num_steps=len(s.timesteps),
        timesteps=_floats(s.timesteps),
        init_noise_sigma=float(s.init_noise_sigma),
        prediction_type="sample" if pred == "original_sample" else pred,
        sigmas=_floats(s.sigmas),
        input_scaling=True,
        config=frozen,
    )


def _dpmpp(s, cfg, frozen) -> Schedule:
    # Lu et al. 2022 (DPM-Solver++) multistep order 2, with diffusers' rules for lowering the order at the end:
    # the first step is always first order; the last is first order when euler_at_final, when the final sigma is
    # zero, or when lower_order_final and the schedule is short (< 15 steps).
    n = len(s.timesteps)
    short = cfg["lower_order_final"] and n < 15
    final_first = cfg["euler_at_final"] or short or cfg["final_sigmas_type"] == "zero"
    orders = tuple(1 if i == 0 or (i == n - 1 and final_first) else 2 for i in range(n))
    return Schedule(
        sampler="dpmpp_2m",
        num_steps=n,
        timesteps=_floats(s.timesteps),
        init_noise_sigma=float(s.init_noise_sigma),
        prediction_type=cfg["prediction_type"],
        sigmas=_floats(s.sigmas),
        orders=orders,
        thresholding=_thresholding(cfg),
        flow_sigmas=bool(cfg["use_flow_sigmas"]),
        config=frozen,
    )


def _flow(s, cfg, frozen) -> Schedule:
    # The flow scheduler has no init_noise_sigma: pipelines use unit-variance noise.
    return Schedule(
        sampler="flow_euler",
        num_steps=len(s.timesteps),
        timesteps=_floats(s.timesteps),
        init_noise_sigma=float(getattr(s, "init_noise_sigma", 1.0)),
        prediction_type="flow",
        sigmas=_floats(s.sigmas),
        stochastic=bool(cfg.get("stochastic_sampling")),
        config=frozen,
    )


_BUILDERS = {
    "ddim": _ddim,
    "euler": _euler,
    "euler_a": functools.partial(_euler, name="euler_a"),
    "dpmpp_2m": _dpmpp,
    "flow_euler": _flow,
}


def new_state(schedule: Schedule, generator: torch.Generator | None = None) -> SamplerState:
    """Fresh per-request state. Samplers that draw noise (euler_a, stochastic flow_euler) need the generator."""
    if not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a Schedule from build_schedule; got {type(schedule).__name__}")
    if generator is None and (schedule.sampler == "euler_a" or schedule.stochastic):
        raise ValueError(f"generator must be a torch.Generator for sampler {schedule.sampler!r}; got None")
    return SamplerState(schedule=schedule, generator=generator)


def init_noise_sigma(schedule: Schedule) -> float:
    """Scale for the initial latents: x_T = randn * init_noise_sigma, as diffusers pipelines prepare them."""
    return schedule.init_noise_sigma
