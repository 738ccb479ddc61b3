"""LoRA adapters under load: the same Poisson trace with and without adapters, served by the default strategy.

1. --adapters random adapters (rank --rank) for the model are written to a folder.
2. `stepserve bench` without adapters at --rate-frac of the model's measured capacity (rate R).
3. `stepserve bench` at the absolute rate R, same seed and mix, the bench loading the folder (--lora-dir) and
   the mix drawing an adapter for --share of the requests (the others plain): the same arrivals and requests.
4. p50 / p95 / p99 of both runs (medians over the repeats), side by side.

    .venv/bin/python benchmarks/lora_load.py --model embedded --adapters 20 --share 0.8 --rank 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import ROOT, add_run_args, percentile_ratios, stepserve, summaries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/lora-load")
    p.add_argument("--adapters", type=int, default=20)
    p.add_argument("--share", type=float, default=0.8, help="requests that carry an adapter")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rate-frac", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.out / "loras"
    code = ("import sys; from stepserve.tiny.lora import build_tiny_lora; "
            "[build_tiny_lora(sys.argv[1], f'{sys.argv[2]}/a{i}.safetensors', seed=i, rank=int(sys.argv[3])) "
            "for i in range(int(sys.argv[4]))]")
    subprocess.run([sys.executable, "-c", code, args.model, str(folder), str(args.rank), str(args.adapters)],
                   check=True, cwd=ROOT)
    steps = [int(s) for s in args.steps.split(",")]
    plain, adapted = args.out / "mix.json", args.out / "mix-lora.json"
    plain.write_text(json.dumps({"steps": steps}))
    weights = {"none": 1.0 - args.share, **{f"a{i}": args.share / args.adapters for i in range(args.adapters)}}
    adapted.write_text(json.dumps({"steps": steps, "lora": weights}))
    common = ["--model", args.model, "--threads", str(args.threads), "--strategies", "slo", "--seed", str(args.seed),
              "--duration", str(args.duration), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
              "--max-batch-size", str(args.max_batch_size), "--no-progress", "--lora-dir", str(folder)]
    stepserve("bench", *common, "--mix", str(plain), "--rate-frac", str(args.rate_frac), "--out",
              str(args.out / "plain"))
    capacity = json.loads((args.out / "plain" / "results.json").read_text())["capacity"]["rps"]
    rate = args.rate_frac * capacity
    stepserve("bench", *common, "--mix", str(adapted), "--rate", f"{rate:.6f}", "--out", str(args.out / "lora"))
    a, b = summaries(args.out / "plain")["slo"], summaries(args.out / "lora")["slo"]
    print(f"\n{args.model}: {rate:.2f} req/s ({args.rate_frac:.0%} of capacity without adapters, {capacity:.2f} "
          f"req/s); {args.share:.0%} of requests carry one of {args.adapters} adapters of rank {args.rank}; "
          f"medians over {args.repeats} repeats")
    row = {"model": args.model, "rate_rps": rate, "capacity_rps": capacity, "adapters": args.adapters,
           "share": args.share, "rank": args.rank}
    row.update(percentile_ratios(a, b, ("plain", "lora")))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
