"""ControlNets under load: the same Poisson trace with and without controlled requests, served by the default
strategy, on a tiny SD at benchmark size (the embedded model's UNet has no mid block, so diffusers makes no
ControlNet of it).

1. A tiny SD folder (UNet widths 64/128) and --controlnets random ControlNets for it are written.
2. `stepserve bench` of a plain mix at --rate-frac of the model's measured capacity (rate R).
3. `stepserve bench` at the absolute rate R, same seed and mix, with the mix drawing a ControlNet for --share of
   the requests (the others plain): the same arrivals and requests otherwise.
4. The plain requests' p50 / p95 in both runs (medians over the repeats), side by side, and the controlled ones'.

    .venv/bin/python benchmarks/control_load.py --share 0.3 --rate-frac 0.7 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import ROOT, add_run_args, stepserve
from edits_load import per_kind


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/control-load")
    p.add_argument("--controlnets", type=int, default=3)
    p.add_argument("--share", type=float, default=0.3, help="requests that carry a ControlNet")
    p.add_argument("--size", default="32x32")
    p.add_argument("--rate-frac", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, folder = args.out / "tiny-sd", args.out / "controlnets"
    code = ("import sys; from stepserve.tiny.sd import build_tiny_sd; "
            "from stepserve.tiny.controlnet import build_tiny_controlnet; "
            "m = build_tiny_sd(sys.argv[1], channels=(64, 128), sample_size=16); "
            "[build_tiny_controlnet(m, f'{sys.argv[2]}/c{i}', seed=i, std=0.05) for i in range(int(sys.argv[3]))]")
    subprocess.run([sys.executable, "-c", code, str(model), str(folder), str(args.controlnets)], check=True, cwd=ROOT)
    steps = [int(s) for s in args.steps.split(",")]
    plain, mixed = args.out / "mix.json", args.out / "mix-control.json"
    plain.write_text(json.dumps({"steps": steps, "size": args.size}))
    weights = {"none": 1.0 - args.share, **{f"c{i}": args.share / args.controlnets for i in range(args.controlnets)}}
    mixed.write_text(json.dumps({"steps": steps, "size": args.size, "control": weights}))
    common = ["--model", str(model), "--threads", str(args.threads), "--strategies", "slo", "--seed", str(args.seed),
              "--duration", str(args.duration), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
              "--max-batch-size", str(args.max_batch_size), "--no-progress", "--controlnet-dir", str(folder)]
    stepserve("bench", *common, "--mix", str(plain), "--rate-frac", str(args.rate_frac), "--out",
              str(args.out / "plain"))
    plain_results = json.loads((args.out / "plain" / "results.json").read_text())
    capacity = plain_results["capacity"]["rps"]
    rate = args.rate_frac * capacity
    stepserve("bench", *common, "--mix", str(mixed), "--rate", f"{rate:.6f}", "--out", str(args.out / "control"))
    mixed_runs = json.loads((args.out / "control" / "results.json").read_text())["runs"]
    alone = plain_results["summaries"][0]
    table = per_kind(mixed_runs)["slo"]
    print(f"\n{rate:.2f} req/s ({args.rate_frac:.0%} of capacity without controls, {capacity:.2f} req/s); "
          f"{args.share:.0%} of requests carry one of {args.controlnets} ControlNets; medians over {args.repeats}")
    row = {"rate_rps": rate, "capacity_rps": capacity, "share": args.share,
           "plain_alone": {"p50": alone["p50_s"]["median"], "p95": alone["p95_s"]["median"]}, **table}
    for q in ("p50", "p95"):
        base, beside = row["plain_alone"][q], table["generation"][q]
        print(f"plain {q}: alone {base * 1000:7.0f} ms, beside controlled requests {beside * 1000:7.0f} ms "
              f"({beside / base:.2f}x); controlled {table['controlled'][q] * 1000:7.0f} ms")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
