"""onnxruntime vs torch on one model (default: the embedded one): images/s through the engine at batch 1 and 8,
and the bare denoiser forward at the same batches, both backends measured in turns in one run.

    python benchmarks/backends.py [--model embedded] [--batches 1,8] [--steps 20] [--rounds 5] [--threads 1]

Each round runs every (backend, batch) cell once, in an order that alternates between rounds, so slow phases of
a noisy machine fall on both backends alike; the table shows medians over the rounds. Prints the table and, last,
a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from stepserve import Engine, SamplingParams

BACKENDS = ("torch", "onnxruntime")


def forward_s(engine: Engine, batch: int, repeats: int) -> float:
    """Median time of one denoiser call over `batch` rows at mixed timesteps (no guidance rows)."""
    pipe = engine.executor.pipeline
    shape = pipe.latent_shape(engine.model_info.default_height, engine.model_info.default_width)
    sample = torch.randn(batch, *shape[1:])
    timestep = torch.linspace(1, 999, batch)
    embeds = torch.stack(pipe.encode_prompts([str(i) for i in range(batch)]))
    pipe.unet_forward(sample, timestep, embeds)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pipe.unet_forward(sample, timestep, embeds)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def images_per_s(engine: Engine, batch: int, steps: int, seed: int) -> float:
    """`batch` requests of `steps` steps each, served together (static batching at that size)."""
    params = [SamplingParams(prompt=str(i % 10), seed=seed + i, num_inference_steps=steps, guidance_scale=1.0)
              for i in range(batch)]
    t0 = time.perf_counter()
    results = engine.generate(params)
    elapsed = time.perf_counter() - t0
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return batch / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {}
    for backend in BACKENDS:
        from stepserve.engine.loading import load_executor

        executor = load_executor(args.model, backend=backend, threads=args.threads)
        engines[backend] = {b: Engine(executor, strategy="static", max_batch_size=b, static_batch_size=b,
                                      max_queue_delay_ms=0) for b in batches}
    ips = {(be, b): [] for be in BACKENDS for b in batches}
    fwd = {(be, b): [] for be in BACKENDS for b in batches}
    for r in range(args.rounds):
        order = [(be, b) for be in BACKENDS for b in batches]
        for backend, batch in order if r % 2 == 0 else reversed(order):
            engine = engines[backend][batch]
            fwd[backend, batch].append(forward_s(engine, batch, 5))
            ips[backend, batch].append(images_per_s(engine, batch, args.steps, seed=1000 * r))
    print(f"model {args.model}, {args.steps} steps, {args.threads} thread(s), medians of {args.rounds} rounds")
    print(f"{'batch':>5} | {'torch img/s':>11} | {'ort img/s':>9} | {'ort/torch':>9} | "
          f"{'torch fwd ms':>12} | {'ort fwd ms':>10} | {'fwd speed-up':>12}")
    summary = {}
    for b in batches:
        t_ips, o_ips = (statistics.median(ips[be, b]) for be in BACKENDS)
        t_fwd, o_fwd = (statistics.median(fwd[be, b]) * 1000 for be in BACKENDS)
        print(f"{b:>5} | {t_ips:>11.1f} | {o_ips:>9.1f} | {o_ips / t_ips:>8.2f}x | {t_fwd:>12.2f} | {o_fwd:>10.2f} "
              f"| {t_fwd / o_fwd:>11.2f}x")
        summary[b] = {"torch_images_per_s": t_ips, "onnxruntime_images_per_s": o_ips,
                      "images_per_s_ratio": o_ips / t_ips, "forward_speedup": t_fwd / o_fwd}
    print(json.dumps({"model": args.model, "steps": args.steps, "threads": args.threads, "batches": summary}))


if __name__ == "__main__":
    main()
