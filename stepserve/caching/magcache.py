"""MagCache's skip schedule (Ma et al., "MagCache: Fast Video Generation with Magnitude-Aware Cache", 2025), as
diffusers 0.42's MagCacheHeadHook decides it: from the step index and the magnitude ratios alone, so it is fixed
per request when it starts."""

from __future__ import annotations

import torch

from .spec import CacheSpec


def magcache_schedule(spec: CacheSpec, num_steps: int) -> list[bool]:
    """Per step: True to run the whole transformer, False to add the residual of the last full step. The
    arithmetic is diffusers' (float32 tensors, the same order of operations), so the schedule is the same."""
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS, nearest_interp

    ratios = FLUX_MAG_RATIOS
    if len(ratios) != num_steps:
        ratios = nearest_interp(ratios, num_steps)
    retention = int(spec.retention_ratio * num_steps + 0.5)
    ratio, count, err = 1.0, 0, 0.0
    have_residual = False
    out = []
    for step in range(num_steps):
        compute = True
        if step >= retention:
            ratio *= ratios[step] if step < len(ratios) else 1.0
            count += 1
            err += abs(1.0 - ratio)
            if have_residual and err <= spec.threshold and count <= spec.max_skip_steps:
                compute = False
            else:
                ratio, count, err = 1.0, 0, 0.0
        out.append(bool(compute) if not isinstance(compute, torch.Tensor) else bool(compute.item()))
        have_residual = have_residual or compute
    return out
