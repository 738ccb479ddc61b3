"""The diffusers scheduler each sampler reproduces, built from the scheduler config a model's pipeline ships.

``build_schedule`` reads its tables off this scheduler; a test (or a user) puts the same scheduler into the diffusers
pipeline to get the reference images.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..request.types import SAMPLER_NAMES, SCHEDULER_CLASSES
from .flow_shift import SHIFT_DEFAULTS, flow_dpmpp_config, is_flow_config

# Config values forced onto the class so that the sampler is what its name says, whatever the model shipped.
OVERRIDES = {
    "dpmpp_2m": {"solver_order": 2, "algorithm_type": "dpmsolver++", "solver_type": "midpoint"},
}


def check_choice(field_name: str, value: Any, allowed: tuple, sampler: str | None = None) -> None:
    if value not in allowed:
        where = f" for sampler {sampler!r}" if sampler else ""
        raise ValueError(f"{field_name} must be one of {allowed}{where}; got {value!r}")


def reference_scheduler(sampler: str, scheduler_config: Mapping[str, Any]):
    """The diffusers scheduler (timesteps not yet set) that ``sampler`` reproduces for a model whose pipeline ships
    ``scheduler_config``: put it in ``pipe.scheduler`` to get the same images from the diffusers pipeline.

    On a flow model's config (``is_flow_config``) "flow_euler" is its FlowMatchEulerDiscreteScheduler and
    "dpmpp_2m" is DPMSolverMultistepScheduler in flow mode (``flow_dpmpp_config``), carrying the model's
    calculate_shift inputs (base/max image seq len and shift) so that a pipeline computing ``mu`` from
    ``scheduler.config`` gets the model's value; the noise-prediction samplers (ddim, euler, euler_a) are refused.
    """
    import diffusers

    check_choice("sampler", sampler, SAMPLER_NAMES)
    config = dict(scheduler_config)
    if sampler != "flow_euler" and is_flow_config(config):
        if sampler != "dpmpp_2m":
            raise ValueError(
                f"sampler must be one of ('flow_euler', 'dpmpp_2m') for a flow-matching model's scheduler config "
                f"(FlowMatchEulerDiscreteScheduler); got {sampler!r}"
            )
        scheduler = diffusers.DPMSolverMultistepScheduler.from_config(flow_dpmpp_config(config))
        scheduler.register_to_config(**{k: config[k] for k in SHIFT_DEFAULTS if config.get(k) is not None})
        return scheduler
    try:
        return getattr(diffusers, SCHEDULER_CLASSES[sampler]).from_config(config, **OVERRIDES.get(sampler, {}))
    except NotImplementedError as e:  # diffusers' way of refusing e.g. an unknown beta schedule
        raise ValueError(f"scheduler_config not supported by sampler {sampler!r}: {e}") from e
