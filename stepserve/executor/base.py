"""The executor seam: runs the stages of a StepPlan and reports how long each took.

Real executors measure their own time; the fake executor computes it from a cost model. Either way the engine
core only ever sees the reported durations, so the same core runs live and in the simulator.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..request.types import ModelInfo, Request


class Executor(Protocol):
    model: ModelInfo

    def prepare(self, requests: list[Request]) -> float:
        """Encode prompts (batched) and create each request's latents and sampler state. Returns seconds."""
        ...

    def denoise(self, requests: list[Request]) -> float:
        """One denoising step for every request, each at its own `step`. Does not advance `step`. Returns seconds."""
        ...

    def decode(self, requests: list[Request]) -> float:
        """Decode finished latents (batched) into `request.image`. Returns seconds."""
        ...

    def preview(self, request: Request) -> Any:
        """A preview image of the request's current latents (for streaming partial images)."""
        ...
