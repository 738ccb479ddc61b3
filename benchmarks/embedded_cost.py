"""Cost profile of a model (default: the embedded one): end-to-end latency of one default request alone, and the
denoiser's cost per image as the batch grows (each image with its guidance rows, as the engine runs it).

    python benchmarks/embedded_cost.py [--model embedded] [--batches 1,2,4,8,16,32] [--repeats 20]

Prints a table and, last, a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from stepserve import Engine, SamplingParams
from stepserve.engine.core import EngineCore
from stepserve.scheduling import make_policy


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def denoise_step_s(executor, batch: int, repeats: int) -> float:
    """Median time of one engine denoising step over `batch` default requests (guidance rows included)."""
    core = EngineCore(executor, make_policy("continuous", batch))
    reqs = [core.add_request(SamplingParams(prompt=f"a handwritten {i % 10}", seed=i, num_inference_steps=1000 // 5),
                             0.0) for i in range(batch)]
    executor.prepare(reqs)
    return median_s(lambda: executor.denoise(reqs), repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, strategy="continuous", max_batch_size=1)
    info = engine.model_info
    one = [SamplingParams(prompt="a handwritten seven", seed=0)]
    engine.generate(one)  # warm-up
    e2e = median_s(lambda: engine.generate(one), max(5, args.repeats // 2))
    print(f"model {info.name}: {info.default_sampler}, {info.default_steps} steps, guidance "
          f"{info.default_guidance_scale}, {info.default_width}x{info.default_height}; threads {args.threads}")
    print(f"one default request alone, end to end: {1000 * e2e:.1f} ms")
    curve = []
    base = None
    print(f"{'batch':>6}{'step ms':>10}{'ms/image':>10}{'vs batch 1':>12}")
    for b in [int(x) for x in args.batches.split(",")]:
        denoise_step_s(engine.executor, b, 3)  # warm-up at this shape
        step = denoise_step_s(engine.executor, b, args.repeats)
        per_image = step / b
        base = per_image if base is None else base
        curve.append({"batch": b, "step_ms": round(1000 * step, 3), "ms_per_image": round(1000 * per_image, 3),
                      "per_image_vs_batch1": round(per_image / base, 3)})
        print(f"{b:>6}{1000 * step:>10.2f}{1000 * per_image:>10.2f}{per_image / base:>12.3f}")
    print(json.dumps({"model": info.name, "threads": args.threads, "end_to_end_ms": round(1000 * e2e, 2),
                      "default_steps": info.default_steps, "curve": curve}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
