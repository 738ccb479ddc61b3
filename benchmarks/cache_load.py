"""Step caching under load: the same Poisson trace served with and without step caching by the default strategy.

1. `stepserve bench` without caching at --rate-frac of the model's measured capacity (the trace's rate R).
2. `stepserve bench` at the absolute rate R with the same seed and mix plus a `cache` field drawn per request
   (--cache-mix, e.g. half "off", half a policy): the same arrivals and requests, some of them cached.
3. p50 / p95 / p99 of both runs (medians over the repeats), side by side.

    .venv/bin/python benchmarks/cache_load.py --model embedded --cache '["off", "deepcache"]'
    .venv/bin/python benchmarks/cache_load.py --model tiny-flux --steps 4,10,20 --cache '["off", "fbcache"]'
"""

from __future__ import annotations

import argparse
import json

from common import add_run_args, percentile_ratios, stepserve, summaries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/cache-load")
    p.add_argument("--cache", default='["off", "deepcache"]', help="the mix's cache field (JSON)")
    p.add_argument("--rate-frac", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    steps = [int(s) for s in args.steps.split(",")]
    plain_mix, cached_mix = args.out / "mix.json", args.out / "mix-cached.json"
    plain_mix.write_text(json.dumps({"steps": steps}))
    cached_mix.write_text(json.dumps({"steps": steps, "cache": json.loads(args.cache)}))
    common = ["--model", args.model, "--threads", str(args.threads), "--strategies", "slo", "--seed", str(args.seed),
              "--duration", str(args.duration), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
              "--max-batch-size", str(args.max_batch_size), "--no-progress"]
    stepserve("bench", *common, "--mix", str(plain_mix), "--rate-frac", str(args.rate_frac),
              "--out", str(args.out / "uncached"))
    capacity = json.loads((args.out / "uncached" / "results.json").read_text())["capacity"]["rps"]
    rate = args.rate_frac * capacity
    stepserve("bench", *common, "--mix", str(cached_mix), "--rate", f"{rate:.6f}", "--out", str(args.out / "cached"))
    a = summaries(args.out / "uncached")["slo"]
    b = summaries(args.out / "cached")["slo"]
    print(f"\n{args.model}: {rate:.2f} req/s ({args.rate_frac:.0%} of uncached capacity {capacity:.2f} req/s), "
          f"cache mix {args.cache}; medians over {args.repeats} repeats")
    row = {"model": args.model, "rate_rps": rate, "capacity_rps": capacity, "cache": json.loads(args.cache),
           "cached_step_frac": b["cached_step_frac"]["median"]}
    print(f"steps that reused cached work in the cached run: {row['cached_step_frac']:.0%}")
    row.update(percentile_ratios(a, b, ("uncached", "cached")))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
