"""Image to image as plain arithmetic (no torch): how much of a request's schedule an input image skips."""

from __future__ import annotations

import math

IMG2IMG_STRENGTH = 0.8  # diffusers' img2img pipelines' default strength


def first_step(num_steps: int, strength: float) -> int:
    """t_start of diffusers' get_timesteps: the steps of an n-step schedule that an image of this strength skips
    (t_start = n - min(int(n * strength), n))."""
    return max(num_steps - min(int(num_steps * strength), num_steps), 0)


def is_valid_strength(strength: object) -> bool:
    return (isinstance(strength, (int, float)) and not isinstance(strength, bool) and math.isfinite(strength)
            and 0 < strength <= 1)
