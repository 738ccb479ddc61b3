"""A fake executor: no model, a deterministic stand-in for the denoiser and a cost model for the time it takes.

It serves the policy and lifecycle tests and the discrete-event simulator. Its "latent" is a float per request
that moves deterministically with each step, so tests can check that every request took each of its steps once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..types import ModelInfo, Request, SAMPLER_NAMES

FAKE_MODEL = ModelInfo(
    name="fake",
    default_sampler="euler",
    default_steps=20,
    default_guidance_scale=3.0,
    default_height=32,
    default_width=32,
    size_multiple=8,
    min_size=16,
    max_size=64,
    samplers=SAMPLER_NAMES,
)


@dataclass
class CostModel:
    """Seconds per stage as a function of batch size and pixels: fixed cost + per-item cost."""

    step_fixed_s: float = 0.010
    step_per_item_s: float = 0.003
    encode_fixed_s: float = 0.002
    encode_per_item_s: float = 0.0005
    decode_fixed_s: float = 0.002
    decode_per_item_s: float = 0.001
    reference_pixels: int = 32 * 32

    def _scale(self, requests: list[Request]) -> float:
        h, w = requests[0].bucket
        return (h * w) / self.reference_pixels

    def step_s(self, requests: list[Request]) -> float:
        cfg_rows = sum(2 if r.params.guidance_scale > 1 else 1 for r in requests)
        return self.step_fixed_s + self.step_per_item_s * cfg_rows * self._scale(requests)

    def encode_s(self, requests: list[Request]) -> float:
        return self.encode_fixed_s + self.encode_per_item_s * len(requests)

    def decode_s(self, requests: list[Request]) -> float:
        return self.decode_fixed_s + self.decode_per_item_s * len(requests) * self._scale(requests)


class FakeExecutor:
    def __init__(
        self,
        model: ModelInfo = FAKE_MODEL,
        cost: CostModel | None = None,
        fault: Callable[[str, list[Request]], bool] | None = None,
    ) -> None:
        self.model = model
        self.cost = cost or CostModel()
        self.fault = fault  # fault(stage, requests) -> True makes that stage raise (for tests)
        self.forward_batch_sizes: list[int] = []

    def _maybe_fail(self, stage: str, requests: list[Request]) -> None:
        if self.fault is not None and self.fault(stage, requests):
            raise RuntimeError(f"injected {stage} fault")

    def prepare(self, requests: list[Request]) -> float:
        self._maybe_fail("prepare", requests)
        for r in requests:
            r.latents = float(r.params.seed % 997)
            r.sampler_state = []  # the steps taken, in order
        return self.cost.encode_s(requests)

    def denoise(self, requests: list[Request]) -> float:
        if len({r.bucket for r in requests}) != 1:
            raise AssertionError("a forward pass mixed shape buckets")
        self._maybe_fail("denoise", requests)
        self.forward_batch_sizes.append(len(requests))
        for r in requests:
            r.latents = r.latents * 0.5 + r.step  # depends only on the request's own history
            r.sampler_state.append(r.step)
        return self.cost.step_s(requests)

    def decode(self, requests: list[Request]) -> float:
        self._maybe_fail("decode", requests)
        for r in requests:
            r.image = r.latents
        return self.cost.decode_s(requests)

    def preview(self, request: Request) -> float:
        return request.latents
