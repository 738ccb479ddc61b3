"""Image to image as plain arithmetic (no torch): how much of a request's schedule an input image skips."""

from __future__ import annotations

import math

IMG2IMG_STRENGTH = 0.8  # diffusers' img2img pipelines' default strength


START_RULES = ("floor_steps", "floor_start")


def first_step(num_steps: int, strength: float, rule: str = "floor_steps") -> int:
    """t_start of the family's diffusers img2img get_timesteps: the steps of an n-step schedule that an image of
    this strength skips. "floor_steps" (SD, SDXL): t_start = n - min(int(n * strength), n); "floor_start" (SD3,
    Flux): t_start = int(max(n - min(n * strength, n), 0)), which runs one step more when n * strength is not whole."""
    if rule == "floor_start":
        return int(max(num_steps - min(num_steps * strength, num_steps), 0))
    return max(num_steps - min(int(num_steps * strength), num_steps), 0)


def is_valid_strength(strength: object) -> bool:
    return (isinstance(strength, (int, float)) and not isinstance(strength, bool) and math.isfinite(strength)
            and 0 < strength <= 1)
