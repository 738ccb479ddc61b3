"""The cost of ControlNets per row: one denoising step of 8 requests where k carry a ControlNet, against the plain
step plus k/8 of a ControlNet forward on all 8, on a tiny SD at benchmark size (UNet widths 64/128, 64x64 images;
the embedded model's UNet has no mid block, so diffusers makes no ControlNet of it), 1 torch thread.

A random ControlNet is made from the model's UNet (`ControlNetModel.from_unet`: the UNet's encoder half
and mid block, as real ControlNets are). Each round times, in rotating order, the step with k = 0, 2, 4, 8
controlled requests (guidance on: 16 denoiser rows, the control on both halves of a controlled request) and the
ControlNet forward alone on the 16 rows of 8 controlled requests, all through the executor as the engine runs it.
The prediction for k is plain step + k/8 x that forward; the table gives the median over --rounds of the measured
step over the prediction, and of the step over the plain step.

    .venv/bin/python benchmarks/control_cost.py --rounds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from common import benchmark_sd
from PIL import Image

from stepserve.controls.rows import residuals
from stepserve.controls.spec import Control
from stepserve.engine.loading import load_executor
from stepserve.profiling.requests import _dummy_requests, _release
from stepserve.tiny.controlnet import build_tiny_controlnet

KS = (0, 2, 4, 8)


def control_image(seed: int, size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))


def measure(model: str, rounds: int, batch: int) -> list[dict]:
    executor = load_executor(model, "cpu", "float32", "torch", 1)
    root = Path(tempfile.mkdtemp())
    build_tiny_controlnet(model, root / "edge", seed=1, std=0.05)
    store = executor.controlnets(root, None)
    info = executor.model_info
    bucket = (info.default_height, info.default_width)
    steps = {}
    for k in KS:
        reqs = _dummy_requests(executor, batch, bucket, 3.0, f"control-{k}")
        for i, r in enumerate(reqs[:k]):
            r.params = replace(r.params, controls=(Control("edge", control_image(i, bucket)),))
        executor.prepare(reqs)
        steps[k] = reqs
    store.ensure(["edge"])
    every = steps[batch if batch in KS else max(KS)]
    times: dict[object, list[float]] = {k: [] for k in (*KS, "forward")}
    ratios: dict[int, list[float]] = {k: [] for k in KS}
    over_plain: dict[int, list[float]] = {k: [] for k in KS}
    for n in range(rounds + 2):
        order = list(KS) + ["forward"]
        order = order[n % len(order):] + order[: n % len(order)]
        got = {}
        for k in order:
            if k == "forward":
                got[k] = forward_s(executor, every)
                continue
            for r in steps[k]:
                r.step = 0  # the same step every round
            got[k] = executor.denoise(steps[k])
        if n < 2:  # warm-up rounds
            continue
        for k in (*KS, "forward"):
            times[k].append(got[k])
        for k in KS:
            ratios[k].append(got[k] / (got[0] + k / batch * got["forward"]))
            over_plain[k].append(got[k] / got[0])
    _release([r for reqs in steps.values() for r in reqs])
    forward_ms = statistics.median(times["forward"]) * 1000
    rows = []
    for k in KS:
        row = {"k": k, "rows": 2 * batch, "step_ms": statistics.median(times[k]) * 1000,
               "forward_ms": forward_ms, "over_prediction": statistics.median(ratios[k]),
               "over_prediction_low": min(ratios[k]), "over_prediction_high": max(ratios[k]),
               "over_plain": statistics.median(over_plain[k])}
        print(f"k={k}: step {row['step_ms']:7.2f} ms, {row['over_plain']:.2f}x the plain step; over plain + k/8 x "
              f"ControlNet forward ({forward_ms:.2f} ms): {row['over_prediction']:.2f} "
              f"({row['over_prediction_low']:.2f}-{row['over_prediction_high']:.2f})", flush=True)
        rows.append(row)
    return rows


@torch.no_grad()
def forward_s(executor, requests) -> float:
    """Seconds of the ControlNet part of a step on `requests` alone (all controlled), as the step runs it."""
    import time

    rows = torch.cat([r.latents for r in requests] * 2)
    t = torch.full((rows.shape[0],), 500.0)
    conditioning = executor.pipeline.collate([r.conditioning.cond for r in requests]
                                             + [r.conditioning.uncond for r in requests])
    plan = [(r.controls, 0, r.num_inference_steps) for r in requests] * 2
    start = time.perf_counter()
    residuals(executor.controlnets(), executor.pipeline, rows, t, conditioning, plan)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-sd", help="tiny-sd (built at benchmark size) or an SD 1/2 folder")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(measure(benchmark_sd(args.model), args.rounds, args.batch)))


if __name__ == "__main__":
    main()
