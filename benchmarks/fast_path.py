"""The fast path on this machine: --compile against eager, and what --deterministic costs, side by side.

Contenders (each its own Engine on the same model, continuous batching, max_batch_size 8):
- eager: the default;
- compiled: the denoiser compiled by inductor for the buckets the run needs (--buckets; compiling happens at
  start-up, its time is printed and not counted);
- deterministic: every forward at one fixed padded shape (2 x max_batch_size denoiser rows);
- compiled+deterministic (with --with-compiled-deterministic).
Each round runs every contender once at batch 1 (requests one after another) and at batch 8 (eight at once), in a
rotating order (all contenders back to back at one batch size), and reports the median images/s per contender
and the median over rounds of its ratio to eager in the same round. Last line: JSON summary.

    python benchmarks/fast_path.py [--model embedded|PATH] [--rounds 7] [--steps 20] [--buckets 2,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from common import pick_model

from stepserve import Engine, SamplingParams
from stepserve.backends.fast_path import FastPathOptions

MAX_BATCH = 8


def params(n: int, steps: int, offset: int) -> list[SamplingParams]:
    return [SamplingParams(prompt=str(d % 10), seed=offset + d, num_inference_steps=steps) for d in range(n)]


def images_per_s(engine: Engine, batch: int, steps: int, images: int, offset: int) -> float:
    start = time.perf_counter()
    done = 0
    while done < images:
        results = engine.generate(params(batch, steps, offset + done))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        done += batch
    return done / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="auto")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--images", type=int, default=8, help="images per contender, batch size and round")
    ap.add_argument("--buckets", default="2,16", help="compiled denoiser batch sizes (rows: guidance doubles them)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--with-compiled-deterministic", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = pick_model(args.model)
    buckets = tuple(int(b) for b in args.buckets.split(","))
    options = {
        "eager": None,
        "compiled": FastPathOptions(compile=True, batch_buckets=buckets),
        "deterministic": FastPathOptions(deterministic=True),
    }
    if args.with_compiled_deterministic:
        options["compiled+deterministic"] = FastPathOptions(compile=True, deterministic=True)
    engines, startup = {}, {}
    for name, fast_path in options.items():
        t0 = time.perf_counter()
        engines[name] = Engine.from_pretrained(model, strategy="continuous", max_batch_size=MAX_BATCH,
                                               memory_cap=False, fast_path=fast_path)
        startup[name] = time.perf_counter() - t0
        print(f"{name}: ready in {startup[name]:.1f} s (load, compile, warm-up)", file=sys.stderr, flush=True)
    names = list(engines)
    samples: dict[tuple[str, int], list[float]] = {(n, b): [] for n in names for b in (1, MAX_BATCH)}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for batch in (1, MAX_BATCH):  # contenders back to back at one batch size: a round's ratios share its load
            for name in order:
                samples[(name, batch)].append(images_per_s(engines[name], batch, args.steps, args.images, r * 1000))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    median = {k: statistics.median(v) for k, v in samples.items()}
    # the ratio to eager within each round, then the median over rounds (robust to load that drifts between rounds)
    ratio = {(n, b): statistics.median(x / e for x, e in zip(samples[(n, b)], samples[("eager", b)]))
             for n in names for b in (1, MAX_BATCH)}
    print(f"model {model}, {args.steps} steps, {torch.get_num_threads()} thread(s), {args.rounds} rounds "
          f"(rotating order), {args.images} images per point; medians")
    print(f"{'contender':<24}{'batch':>6}{'img/s':>9}{'min':>8}{'max':>8}{'vs eager (median of rounds)':>29}")
    for name in names:
        for batch in (1, MAX_BATCH):
            v = samples[(name, batch)]
            per_round = sorted(x / e for x, e in zip(v, samples[("eager", batch)]))
            print(f"{name:<24}{batch:>6}{median[(name, batch)]:>9.2f}{min(v):>8.2f}{max(v):>8.2f}"
                  f"{ratio[(name, batch)]:>12.2f}x  ({per_round[0]:.2f}-{per_round[-1]:.2f})")
    summary = {"model": model, "steps": args.steps, "rounds": args.rounds, "threads": torch.get_num_threads(),
               "buckets": buckets, "startup_s": startup,
               "images_per_s": {f"{n}@{b}": median[(n, b)] for n in names for b in (1, MAX_BATCH)},
               "ratio_vs_eager": {f"{n}@{b}": ratio[(n, b)] for n in names for b in (1, MAX_BATCH)}}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
