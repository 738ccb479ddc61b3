"""Flow-matching models' per-request schedule options: the resolution-dependent shift ``mu``, the sigmas a pipeline
passes explicitly, and the mapping from a flow model's scheduler config to the diffusers scheduler each sampler
reproduces.

Flow models (SD3, Flux) ship a ``FlowMatchEulerDiscreteScheduler`` config. With ``use_dynamic_shifting`` the
schedule depends on the image size: the pipeline computes ``mu`` from the image token count (diffusers'
``calculate_shift``, a line through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift)) and passes
it to ``set_timesteps``, which shifts every sigma by ``exp(mu) / (exp(mu) + (1 / sigma - 1))`` (Esser et al. 2024,
"Scaling Rectified Flow Transformers", Sec. 5.3.2). Requests of different sizes thus follow different schedules.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

# FlowMatchEulerDiscreteScheduler's constructor defaults for the calculate_shift inputs (what the pipelines read
# from ``scheduler.config``, which always holds them). StableDiffusion3Pipeline falls back to max_shift 1.16 only for
# a config without the key, which a saved FlowMatchEulerDiscreteScheduler config never is.
SHIFT_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}

# What the caller's pipeline passes to set_timesteps as ``sigmas``:
#   None       -- nothing: the scheduler spaces its own sigmas (StableDiffusion3Pipeline)
#   "linspace" -- np.linspace(1.0, 1 / num_steps, num_steps) (FluxPipeline), dropped for a scheduler with
#                 use_flow_sigmas, as FluxPipeline drops it
SIGMAS_CHOICES = (None, "linspace")

# Options of a flow model's FlowMatchEulerDiscreteScheduler config that DPMSolverMultistepScheduler's flow mode
# cannot reproduce; dpmpp_2m refuses such a config rather than silently changing the schedule.
_DPM_UNSUPPORTED = ("shift_terminal", "invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


def is_flow_config(scheduler_config: Mapping[str, Any]) -> bool:
    """True for a flow-matching model's scheduler config: a ``_class_name`` of diffusers' FlowMatch* schedulers (a
    saved scheduler_config.json) or, for ``scheduler.config`` (which has no ``_class_name``), their own ``shift``
    parameter, which no noise-prediction scheduler has."""
    name = scheduler_config.get("_class_name")
    if name is not None:
        return str(name).startswith("FlowMatch")
    return "shift" in scheduler_config


def uses_dynamic_shifting(scheduler_config: Mapping[str, Any]) -> bool:
    """Whether schedules built from this config need a per-request ``mu`` (``use_dynamic_shifting``)."""
    return bool(scheduler_config.get("use_dynamic_shifting"))


def flow_shift_mu(image_seq_len: int, scheduler_config: Mapping[str, Any]) -> float:
    """diffusers' ``calculate_shift`` (pipeline_flux.py, pipeline_stable_diffusion_3.py) with the config's
    base/max image sequence lengths and shifts: mu = image_seq_len * m + b on the line through
    (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift). Same float operations, same result.

    ``image_seq_len`` is the number of image tokens the transformer sees: Flux (h/16)*(w/16) for a pixel size h x w,
    SD3 (latent_h / patch_size) * (latent_w / patch_size).
    """
    if isinstance(image_seq_len, bool) or not isinstance(image_seq_len, numbers.Integral) or image_seq_len < 1:
        raise ValueError(f"image_seq_len must be a positive integer (image tokens); got {image_seq_len!r}")
    image_seq_len = int(image_seq_len)
    if not isinstance(scheduler_config, Mapping):
        raise ValueError(f"scheduler_config must be a mapping; got {type(scheduler_config).__name__}")
    values = {}
    for key, default in SHIFT_DEFAULTS.items():
        v = scheduler_config.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"scheduler_config[{key!r}] must be a finite number to compute mu; got {v!r}")
        values[key] = v
    base_seq, max_seq = values["base_image_seq_len"], values["max_image_seq_len"]
    if max_seq == base_seq:
        raise ValueError(f"max_image_seq_len must differ from base_image_seq_len; both are {base_seq!r}")
    m = (values["max_shift"] - values["base_shift"]) / (max_seq - base_seq)
    b = values["base_shift"] - m * base_seq
    return image_seq_len * m + b


def pipeline_sigmas(sigmas: str | None, num_steps: int) -> np.ndarray | None:
    """The ``sigmas`` argument the caller's pipeline hands to ``set_timesteps`` (see SIGMAS_CHOICES)."""
    if sigmas is None:
        return None
    if sigmas == "linspace":  # FluxPipeline.__call__, step 5
        return np.linspace(1.0, 1 / num_steps, num_steps)
    raise ValueError(f"sigmas must be one of {SIGMAS_CHOICES}; got {sigmas!r}")


def flow_dpmpp_config(scheduler_config: Mapping[str, Any]) -> dict[str, Any]:
    """The DPMSolverMultistepScheduler config that runs DPM-Solver++(2M) in flow mode for a flow model.

    From the model's FlowMatchEulerDiscreteScheduler config: ``use_flow_sigmas`` (alpha_t = 1 - sigma_t),
    ``prediction_type="flow_prediction"`` (the transformer predicts the velocity), ``flow_shift = shift``, and
    ``use_dynamic_shifting`` carried over (DPMSolverMultistepScheduler then sets flow_shift = exp(mu), the same
    exponential time shift). Solver: order 2, dpmsolver++, midpoint; everything else at diffusers' defaults
    (final_sigmas_type "zero", lower_order_final). Raises ValueError for options the DPM flow mode cannot reproduce.
    """
    cfg = dict(scheduler_config)
    for key in _DPM_UNSUPPORTED:
        if cfg.get(key):
            raise ValueError(
                f"scheduler_config[{key!r}]={cfg[key]!r} is not supported by sampler 'dpmpp_2m' on a flow model "
                f"(DPMSolverMultistepScheduler's flow sigmas have no such option); use 'flow_euler'"
            )
    if uses_dynamic_shifting(cfg) and cfg.get("time_shift_type", "exponential") != "exponential":
        raise ValueError(
            "time_shift_type must be one of ('exponential',) for sampler 'dpmpp_2m' with use_dynamic_shifting; "
            f"got {cfg.get('time_shift_type')!r}"
        )
    return {
        "num_train_timesteps": cfg.get("num_train_timesteps", 1000),
        "use_flow_sigmas": True,
        "flow_shift": float(cfg.get("shift", 1.0)),
        "prediction_type": "flow_prediction",
        "use_dynamic_shifting": uses_dynamic_shifting(cfg),
        "time_shift_type": "exponential",
        "solver_order": 2,
        "algorithm_type": "dpmsolver++",
        "solver_type": "midpoint",
    }
