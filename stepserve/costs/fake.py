"""The fake executor: no model, a deterministic stand-in for the denoiser, and a cost function for the time each
stage takes.

The cost function is a CostModel (fixed + per-item seconds, the default) or the charges of a measured LatencyModel
(`FakeExecutor.charging`, the simulator's engines). Without `sleep` a stage takes no real time and reports what the
cost function says (tests, the simulated clock); with `sleep` it really sleeps that long and reports the time it
slept (`--model fake` on the wall clock).

Its "latent" is a float per request that moves deterministically with each step, so tests can check that every
request took each of its steps once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from ..request.types import SAMPLER_NAMES, ModelInfo, Request
from .charges import LatencyCharges
from .cost_model import CostModel
from .latency_model import LatencyModel

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
    # edits are requests that start part-way through their schedule; the fake charges their steps (no VAE encode)
    img2img=True,
    inpaint="blend",
)


class Cost(Protocol):
    """Seconds each stage takes for a batch of requests."""

    def encode_s(self, requests: list[Request]) -> float: ...

    def step_s(self, requests: list[Request]) -> float: ...

    def decode_s(self, requests: list[Request]) -> float: ...


def model_for(latency: LatencyModel) -> ModelInfo:
    """The model a fake executor charging `latency` validates requests against: the fake model's limits and
    defaults, with the latency model's reference bucket as the default size (so a request without a size costs
    what was profiled)."""
    h, w = latency.reference_bucket
    biggest = max(max(b) for b in list(latency.step) + list(latency.decode))
    return replace(FAKE_MODEL, name=str(latency.metadata.get("model") or "simulated"), default_height=h,
                   default_width=w, min_size=min(FAKE_MODEL.min_size, h, w),
                   max_size=max(FAKE_MODEL.max_size, biggest), size_multiple=1)


class FakeExecutor:
    def __init__(
        self,
        model: ModelInfo = FAKE_MODEL,
        cost: Cost | None = None,
        fault: Callable[[str, list[Request]], bool] | None = None,
        sleep: bool = False,
    ) -> None:
        self.model_info = model
        self.cost = cost or CostModel()
        self.fault = fault  # fault(stage, requests) -> True makes that stage raise (for tests)
        self.sleep = sleep
        self.forward_batch_sizes: list[int] = []

    @classmethod
    def charging(cls, latency: LatencyModel, noise: float = 0.0, seed: int = 0) -> FakeExecutor:
        """A fake executor that charges a measured latency model (see LatencyCharges for `noise` and `seed`)."""
        return cls(model_for(latency), LatencyCharges(latency, noise, seed))

    def _maybe_fail(self, stage: str, requests: list[Request]) -> None:
        if self.fault is not None and self.fault(stage, requests):
            raise RuntimeError(f"injected {stage} fault")

    @staticmethod
    def _slept(seconds: float) -> float:
        start = time.perf_counter()
        time.sleep(seconds)
        return time.perf_counter() - start

    def prepare(self, requests: list[Request]) -> float:
        self._maybe_fail("prepare", requests)
        for r in requests:
            r.latents = float(r.params.seed % 997)
            r.sampler_state = []  # the steps taken, in order
        seconds = self.cost.encode_s(requests)
        return self._slept(seconds) if self.sleep else seconds

    def denoise(self, requests: list[Request]) -> float:
        if not requests:
            return 0.0
        bucket = requests[0].bucket
        for r in requests:
            if r.bucket != bucket:
                raise ValueError(f"a denoising batch mixes shape buckets {bucket} and {r.bucket}")
        self._maybe_fail("denoise", requests)
        self.forward_batch_sizes.append(len(requests))
        for r in requests:
            r.latents = r.latents * 0.5 + r.step  # depends only on the request's own history
            r.sampler_state.append(r.step)
        seconds = self.cost.step_s(requests)
        return self._slept(seconds) if self.sleep else seconds

    def decode(self, requests: list[Request]) -> float:
        self._maybe_fail("decode", requests)
        for r in requests:
            r.image = r.latents
        seconds = self.cost.decode_s(requests)
        return self._slept(seconds) if self.sleep else seconds

    def preview(self, request: Request) -> float:
        return request.latents
