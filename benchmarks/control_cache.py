"""What step caching saves on requests with a ControlNet: a batch of 8 guided requests (20 steps) generated
uncached and with deepcache (interval 3), with and without a ControlNet on every request, on a tiny SD at benchmark
size (UNet widths 64/128, 64x64 images), 1 torch thread. A reused step skips the UNet's deep part only: the
ControlNet still runs on every step for the shallow residuals, so caching saves less on controlled requests.

Each round generates the four cases in rotating order; the table gives the median over --rounds of each case's
seconds over the plain uncached batch's.

    .venv/bin/python benchmarks/control_cache.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import benchmark_sd, rotating_rounds
from PIL import Image

from stepserve import Engine, SamplingParams
from stepserve.tiny.controlnet import build_tiny_controlnet

CASES = ("plain", "plain + deepcache:3", "controlled", "controlled + deepcache:3")


def batch(case: str, size: int, steps: int) -> list[SamplingParams]:
    out = []
    for i in range(8):
        p = SamplingParams(prompt=f"a small cat {i}", seed=i, num_inference_steps=steps, guidance_scale=4.0,
                           height=size, width=size,
                           cache={"policy": "deepcache", "interval": 3} if "deepcache" in case else "off")
        if case.startswith("controlled"):
            picture = np.random.default_rng(i).integers(0, 255, (size, size, 3), dtype=np.uint8)
            p.controls = [{"name": "edge", "image": Image.fromarray(picture)}]
        out.append(p)
    return out


def measure(model: str, rounds: int, steps: int) -> list[dict]:
    root = Path(tempfile.mkdtemp())
    build_tiny_controlnet(model, root / "edge", seed=1, std=0.05)
    engine = Engine.from_pretrained(model, strategy="static", static_batch_size=8, max_batch_size=8,
                                    controlnet_dir=str(root), threads=1)
    size = engine.model_info.default_height
    cached: dict[str, int] = {}

    def generate(case: str) -> float:
        start = time.perf_counter()
        results = engine.generate(batch(case, size, steps))
        seconds = time.perf_counter() - start
        assert all(r.ok for r in results), [r.error for r in results]
        cached[case] = results[0].timing.cached_steps
        return seconds

    times = rotating_rounds(list(CASES), generate, rounds)
    seconds = {case: [t / p for t, p in zip(times[case], times["plain"])] for case in CASES}
    rows = []
    for case in CASES:
        row = {"case": case, "over_plain": statistics.median(seconds[case]), "low": min(seconds[case]),
               "high": max(seconds[case]), "cached_steps": cached[case], "steps": steps}
        print(f"{case:26s} {row['over_plain']:.2f}x the plain uncached batch's time ({row['low']:.2f}-"
              f"{row['high']:.2f}); {cached[case]} of {steps} steps reused", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-sd", help="tiny-sd (built at benchmark size) or an SD 1/2 folder")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(measure(benchmark_sd(args.model), args.rounds, args.steps)))


if __name__ == "__main__":
    main()
