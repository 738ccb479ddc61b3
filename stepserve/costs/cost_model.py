"""The simplest cost function: seconds per stage as a fixed cost plus a cost per item, scaled by pixels.

The fake executor charges it by default (tests, `--model fake`); LatencyModel.from_cost_model turns it into a
latency model with exactly these costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..request.buckets import bucket_pixels
from ..request.types import Request


@dataclass
class CostModel:
    """Seconds per stage as a function of batch size and pixels (a video's frames counted): fixed cost + per-item
    cost."""

    step_fixed_s: float = 0.010
    step_per_item_s: float = 0.003
    encode_fixed_s: float = 0.002
    encode_per_item_s: float = 0.0005
    decode_fixed_s: float = 0.002
    decode_per_item_s: float = 0.001
    reference_pixels: int = 32 * 32

    def _scale(self, requests: list[Request]) -> float:
        return bucket_pixels(requests[0].bucket) / self.reference_pixels

    def step_s(self, requests: list[Request]) -> float:
        cfg_rows = sum(2 if r.params.guidance_scale > 1 else 1 for r in requests)
        return self.step_fixed_s + self.step_per_item_s * cfg_rows * self._scale(requests)

    def encode_s(self, requests: list[Request]) -> float:
        return self.encode_fixed_s + self.encode_per_item_s * len(requests)

    def decode_s(self, requests: list[Request]) -> float:
        return self.decode_fixed_s + self.decode_per_item_s * len(requests) * self._scale(requests)
