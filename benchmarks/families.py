"""Per model family (every `stepserve.tiny.<family>` builder that exists): what batching buys on its pipeline.

1. Per-image cost at batch 8 against batch 1: the same 8 requests (one size, 8 steps, the family's default
   guidance; a video family's default frames, so a sample is a video) generated with continuous batching at
   max_batch_size 8 and at max_batch_size 1; seconds per sample (encode + denoise + decode), rounds alternated,
   medians reported.
2. Continuous against dynamic batching on one mixed open-loop trace: `stepserve bench` (Poisson arrivals at
   --load x the capacity estimated from the batch-8 cost, steps 2/4/8, guidance off or on, two size buckets;
   dynamic with a 50 ms queue delay), p50/p95; in process, so a video family's requests are videos of its default
   frames (the mix's `frames`), as the per-sample cost is.

The tiny test models are so small that a forward costs about the same at any batch size, which would make batching
look free. Each family is built at the size its module's BENCH_OPTIONS gives (wider UNets, larger native size for
sd/sdxl); a module without BENCH_OPTIONS runs at its test size, and the output says which.

    python benchmarks/families.py [--families sd,sdxl,sd3,flux] [--rounds 3] [--duration 30] [--load 0.7] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import stepserve

from stepserve import Engine, SamplingParams
from stepserve.engine.loading import load_executor
from stepserve.tiny import FAMILY_MODULES


def build(family: str, root: Path) -> tuple[Path, str] | None:
    """The family's benchmark-sized tiny folder and a note on its size; None when no builder exists."""
    try:
        module = importlib.import_module(f"stepserve.tiny.{family}")
    except ModuleNotFoundError:
        return None
    options = getattr(module, "BENCH_OPTIONS", None)
    path = getattr(module, f"build_tiny_{family}")(root / family, seed=0, **(options or {}))
    return path, (f"BENCH_OPTIONS {options}" if options else "test size (no BENCH_OPTIONS)")


def denoiser_params(executor) -> int:
    networks = executor.pipeline.networks
    for name in ("unet", "transformer"):
        module = getattr(networks, name, None) or getattr(executor.pipeline, name, None)
        if isinstance(module, torch.nn.Module):
            return sum(p.numel() for p in module.parameters())
    return 0


def per_image_s(executor, params: list[SamplingParams], batch: int) -> float:
    engine = Engine(executor, strategy="continuous", max_batch_size=batch)
    start = time.perf_counter()
    results = engine.generate(params)
    elapsed = time.perf_counter() - start
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return elapsed / len(params)


def batch_cost(executor, rounds: int) -> tuple[float, float]:
    info = executor.model_info
    frames = info.default_frames if info.video else None  # a video family's sample is a video
    params = [SamplingParams(prompt=f"a picture number {i}", seed=i, num_inference_steps=8,
                             guidance_scale=info.default_guidance_scale, num_frames=frames) for i in range(8)]
    per_image_s(executor, params[:2], 2)  # warm-up
    costs: dict[int, list[float]] = {1: [], 8: []}
    for k in range(rounds):
        for batch in ((1, 8) if k % 2 == 0 else (8, 1)):  # alternate the order: drifting load hits both
            costs[batch].append(per_image_s(executor, params, batch))
    return statistics.median(costs[1]), statistics.median(costs[8])


def mix_for(info) -> dict:
    """Steps 2/4/8, guidance off or the default, two size buckets: the default and one bucket larger (a video
    family's at its default frames)."""
    h, w = info.default_height, info.default_width
    taller = min(h + 2 * info.size_multiple, info.max_size)
    guidance = [1.0, info.default_guidance_scale] if info.guidance == "cfg" else [info.default_guidance_scale]
    mix = {"steps": [2, 4, 8], "guidance_scale": guidance, "sampler": info.default_sampler,
           "size": [f"{w}x{h}", f"{w}x{taller}"], "prompts": ["a lighthouse", "a red fox in snow", "night city"]}
    if info.video:
        mix["frames"] = [info.default_frames]
    return mix


def guided_by_default(executor) -> bool:
    """Whether a request at the default guidance (and no negative prompt, as the bench mix sends) runs an
    unconditional row: the family's own answer (Qwen-Image guides only with a negative prompt)."""
    info = executor.model_info
    params = SamplingParams(prompt="a", seed=0, num_inference_steps=2, guidance_scale=info.default_guidance_scale,
                            height=info.default_height, width=info.default_width, sampler=info.default_sampler)
    return executor.pipeline.encode([params])[0].guided


def trace_rate(guided: bool, per_image_b8_s: float, load: float) -> float:
    """Arrivals per second at `load` x the capacity estimated from the batch-8 cost: that cost is for 8 steps at
    the default guidance; the mix averages (2 + 4 + 8) / 3 steps and (where the default guidance runs an
    unconditional row) half its requests run one row instead of two."""
    rows = 0.75 if guided else 1.0
    seconds_per_request = per_image_b8_s * (14 / 3) / 8 * rows
    return load / seconds_per_request


def strategy_p95(path: Path, info, rate: float, args, out: Path) -> tuple[dict[str, dict], str]:
    out.mkdir(parents=True, exist_ok=True)
    mix = out / "mix.json"
    mix.write_text(json.dumps(mix_for(info)))
    stepserve("bench", "--model", str(path), "--strategies", "continuous,dynamic", "--dynamic-delays-ms", "50",
              "--mix", str(mix),
              "--rate", f"{rate:.3f}", "--duration", str(args.duration), "--warmup", "3",
              "--capacity-duration", str(args.capacity_duration), "--max-batch-size", "8",
              "--repeats", str(args.repeats), "--threads", str(args.threads), "--seed", "0", "--no-progress",
              "--out", str(out / "bench"))
    results = json.loads((out / "bench" / "results.json").read_text())
    by_strategy = {s["contender"].split("(")[0]: s for s in results["summaries"]}  # "dynamic(50ms)" -> dynamic
    return by_strategy, results["load_description"]


def _seconds(spread: dict) -> float:
    """The median of a summary's spread; a run that finished too little to have one counts as unbounded."""
    value = spread.get("median")
    return float("inf") if value is None else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILY_MODULES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--capacity-duration", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=0.7, help="trace rate / capacity estimated from the batch-8 cost")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = args.out or Path(tempfile.mkdtemp(prefix="families-"))
    rows = []
    for family in args.families.split(","):
        built = build(family, root / "models")
        if built is None:
            print(f"{family}: no stepserve.tiny.{family} builder; skipped", flush=True)
            continue
        path, size_note = built
        executor = load_executor(str(path))
        info = executor.model_info
        b1, b8 = batch_cost(executor, args.rounds)
        n_params = denoiser_params(executor)
        guided = guided_by_default(executor)
        frames = f"x{info.default_frames} frames" if info.video else ""
        print(f"{family}: {n_params / 1e6:.2f} M denoiser parameters ({size_note}), {info.default_width}x"
              f"{info.default_height}{frames}; per sample at batch 1 {b1 * 1e3:.0f} ms, at batch 8 {b8 * 1e3:.0f} ms "
              f"(x{b8 / b1:.2f})", flush=True)
        del executor
        summaries, load = strategy_p95(path, info, trace_rate(guided, b8, args.load), args, root / family)
        p95 = {name: _seconds(summaries[name]["p95_s"]) for name in ("continuous", "dynamic")}
        p50 = {name: _seconds(summaries[name]["p50_s"]) for name in ("continuous", "dynamic")}
        print(f"{family}: {load}; p50 continuous {p50['continuous'] * 1e3:.0f} ms, dynamic "
              f"{p50['dynamic'] * 1e3:.0f} ms; p95 continuous {p95['continuous'] * 1e3:.0f} ms, dynamic "
              f"{p95['dynamic'] * 1e3:.0f} ms (continuous/dynamic x{p95['continuous'] / p95['dynamic']:.2f})",
              flush=True)
        rows.append((family, n_params, b1, b8, p50, p95))
    print("\n| family | denoiser params | ms/image batch 1 | ms/image batch 8 | batch 8 / batch 1 | p95 continuous | "
          "p95 dynamic | continuous / dynamic |")
    print("|---|---|---|---|---|---|---|---|")
    for family, n, b1, b8, _, p95 in rows:
        print(f"| {family} | {n / 1e6:.2f} M | {b1 * 1e3:.0f} | {b8 * 1e3:.0f} | {b8 / b1:.2f} | "
              f"{p95['continuous'] * 1e3:.0f} ms | {p95['dynamic'] * 1e3:.0f} ms | "
              f"{p95['continuous'] / p95['dynamic']:.2f} |")
    print(f"\n(models and bench output in {root}; python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{args.threads} torch thread(s))")


if __name__ == "__main__":
    main()
