"""Step caching on the embedded model: for each policy setting, the share of steps that reused cached work,
images/s against uncached serving, the digit classifier's accuracy (train-embedded's evaluation: does the image
show the digit asked for?) and PSNR / SSIM against the uncached image of the same request.

Every setting generates the same requests (the 20 evaluation prompts x --seeds) through one in-process Engine
(continuous batching, --max-batch-size, all requests submitted at once, 1 torch thread); each round runs every
setting once, in rotating order, and images/s is the median over --rounds. Images do not depend on the round.

    .venv/bin/python benchmarks/step_cache.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from stepserve import Engine, SamplingParams
from stepserve.bench.quality import psnr, ssim
from stepserve.training.evaluate import digit_classifier, eval_prompts, image_to_8x8

SETTINGS = ["off", "deepcache:2", "deepcache:3", "deepcache:4", "fbcache:0.05", "fbcache:0.1", "fbcache:0.2",
            "fbcache:0.3", "fbcache:0.5"]


def spec(setting: str):
    """'off', 'deepcache:N' or 'fbcache:T' -> the request's cache field."""
    if setting == "off":
        return "off"
    policy, knob = setting.split(":")
    return {"policy": policy, "interval" if policy == "deepcache" else "threshold": float(knob)
            if policy != "deepcache" else int(knob)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args()
    torch.set_num_threads(1)
    settings = args.settings.split(",")
    if settings[0] != "off":
        settings.insert(0, "off")  # the reference
    seeds = [int(s) for s in args.seeds.split(",")]
    prompts = eval_prompts()
    wanted = np.array([d for _ in seeds for _, d in prompts])
    engine = Engine.from_pretrained("embedded", strategy="continuous", max_batch_size=args.max_batch_size)
    engine.generate([SamplingParams(prompt="warm up", seed=0, num_inference_steps=2)])

    def run(setting):
        params = [SamplingParams(prompt=text, seed=1000 * s + i, num_inference_steps=args.steps, cache=spec(setting))
                  for s in seeds for i, (text, _) in enumerate(prompts)]
        start = time.perf_counter()
        results = engine.generate(params)
        return time.perf_counter() - start, results

    seconds: dict[str, list[float]] = {s: [] for s in settings}
    images: dict[str, list] = {}
    for k in range(args.rounds):
        for setting in settings[k % len(settings):] + settings[:k % len(settings)]:
            dt, results = run(setting)
            seconds[setting].append(dt)
            images[setting] = results
            print(f"round {k + 1}/{args.rounds} {setting}: {dt:.2f} s", flush=True)
    clf = digit_classifier()
    rows = []
    base_rate = len(wanted) / statistics.median(seconds["off"])
    for setting in settings:
        results = images[setting]
        pred = clf.predict(np.stack([image_to_8x8(r.image) for r in results]))
        rate = len(results) / statistics.median(seconds[setting])
        ref = images["off"]
        rows.append({
            "setting": setting,
            "skipped": sum(r.timing.cached_steps for r in results) / (len(results) * args.steps),
            "images_per_s": rate, "speedup": rate / base_rate,
            "accuracy": float((pred == wanted).mean()),
            "psnr_db": float(np.mean([min(psnr(a.image, b.image), 99.0) for a, b in zip(results, ref)])),
            "ssim": float(np.mean([ssim(a.image, b.image) for a, b in zip(results, ref)])),
        })
    print(f"\n{'setting':14} {'skipped':>8} {'images/s':>9} {'speedup':>8} {'accuracy':>9} {'PSNR dB':>8} {'SSIM':>6}")
    for r in rows:
        print(f"{r['setting']:14} {r['skipped']:8.0%} {r['images_per_s']:9.1f} {r['speedup']:7.2f}x "
              f"{r['accuracy']:9.1%} {r['psnr_db']:8.1f} {r['ssim']:6.3f}")
    print("(PSNR is capped at 99 dB for identical images)")
    out = {"steps": args.steps, "seeds": seeds, "rounds": args.rounds, "max_batch_size": args.max_batch_size,
           "images": len(wanted), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
