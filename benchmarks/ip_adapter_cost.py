"""The cost of IP-Adapter image prompts per row: one denoising step of 8 guided requests (16 UNet rows) where some
carry an image prompt, against the plain step, on a tiny SD at benchmark size (UNet widths 64/128, 64x64 images),
1 torch thread.

Cases: k = 0, 2, 8 requests with one adapter; 8 split between two adapters (4 + 4: both adapters' image attention
in one forward, each row scaled for its own); 8 with both adapters each (a list of two image prompts). The image
embeddings are computed before timing (once per request, at its first step, as the engine does); each round times
the cases in rotating order, and the table gives the median over --rounds of each step over the plain step.

    .venv/bin/python benchmarks/ip_adapter_cost.py --rounds 20
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
from common import benchmark_sd, rotating_rounds
from PIL import Image

from stepserve.engine.loading import load_executor
from stepserve.ipadapter.spec import ImagePrompt
from stepserve.profiling.requests import _dummy_requests, _release
from stepserve.tiny.ipadapter import build_tiny_ip_adapter

CASES = {  # name -> the adapters of each of the 8 requests
    "k=0": [()] * 8,
    "k=2 (one adapter)": [("a",)] * 2 + [()] * 6,
    "k=8 (one adapter)": [("a",)] * 8,
    "k=8 (two adapters, 4 + 4)": [("a",)] * 4 + [("b",)] * 4,
    "k=8 (both adapters each)": [("a", "b")] * 8,
}


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (64, 64, 3), dtype=np.uint8))


def measure(model: str, rounds: int) -> list[dict]:
    executor = load_executor(model, "cpu", "float32", "torch", 1)
    root = Path(tempfile.mkdtemp())
    for seed, name in enumerate("ab", start=1):
        build_tiny_ip_adapter(model, root / name, seed=seed, std=0.05, encoder_seed=0)
    executor.ip_adapters(root)
    info = executor.model_info
    bucket = (info.default_height, info.default_width)
    steps = {}
    for case, adapters in CASES.items():
        reqs = _dummy_requests(executor, len(adapters), bucket, 3.0, f"ip-{case}")
        for i, (r, names) in enumerate(zip(reqs, adapters)):
            if names:
                r.params = replace(r.params, ip_adapter=tuple(ImagePrompt(n, picture(i), 0.8) for n in names))
        executor.prepare(reqs)  # the image embeddings, once per request
        steps[case] = reqs
    def step(case: str) -> float:
        for r in steps[case]:
            r.step = 0  # the same step every round
        return executor.denoise(steps[case])

    times = rotating_rounds(list(CASES), step, rounds, warmup=2)
    over_plain = {case: [t / p for t, p in zip(times[case], times["k=0"])] for case in CASES}
    _release([r for reqs in steps.values() for r in reqs])
    rows = []
    for case in CASES:
        row = {"case": case, "step_ms": statistics.median(times[case]) * 1000,
               "over_plain": statistics.median(over_plain[case]), "low": min(over_plain[case]),
               "high": max(over_plain[case])}
        print(f"{case:28s} step {row['step_ms']:7.2f} ms, {row['over_plain']:.3f}x the plain step "
              f"({row['low']:.3f}-{row['high']:.3f})", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny-sd", help="tiny-sd (built at benchmark size) or an SD 1/2 folder")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(measure(benchmark_sd(args.model), args.rounds)))


if __name__ == "__main__":
    main()
