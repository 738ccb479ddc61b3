"""Vectorised per-sample samplers.

A batch may hold requests at different steps of different schedules (and different samplers); each row's scalars
are looked up in its own ``Schedule`` at its own step index. The math reproduces the corresponding diffusers
schedulers row by row.
"""

from .batch import model_inputs, predicted_original, sampler_step
from .flow_shift import flow_dpmpp_config, flow_shift_mu, is_flow_config, uses_dynamic_shifting
from .reference import reference_scheduler
from .schedules import SAMPLER_NAMES, SamplerState, Schedule, build_schedule, init_noise_sigma, new_state

__all__ = [
    "SAMPLER_NAMES",
    "Schedule",
    "SamplerState",
    "build_schedule",
    "new_state",
    "init_noise_sigma",
    "model_inputs",
    "sampler_step",
    "predicted_original",
    "flow_shift_mu",
    "uses_dynamic_shifting",
    "is_flow_config",
    "flow_dpmpp_config",
    "reference_scheduler",
]
