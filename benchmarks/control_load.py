"""ControlNets under load: the same Poisson trace with and without controlled requests, served by the default
strategy, on a tiny SD at benchmark size (the embedded model's UNet has no mid block, so diffusers makes no
ControlNet of it).

1. A tiny SD folder (UNet widths 64/128) and --controlnets random ControlNets for it are written.
2. `stepserve bench` of the mix drawing a ControlNet for --share of the requests (the others plain) at --rate-frac
   of the capacity measured on that mix (rate R: the controlled requests' extra work is inside the 70%).
3. `stepserve bench` at the absolute rate R, same seed, the mix without ControlNets: the same arrivals and
   requests otherwise.
4. The baseline: the same mixed run with one pipeline per control setting. Servers that keep a pipeline per
   ControlNet cannot put requests with different controls (or none) into one forward; on one device their
   pipelines take turns. Modelled here with the same scheduler over an executor that splits every step's batch by
   control setting and runs each part as its own forward, one after the other (OnePipelinePerControl).
5. The plain requests' p50 / p95 beside controlled ones against the plain run, and the controlled requests' p95
   against the baseline's (medians over the repeats).

    .venv/bin/python benchmarks/control_load.py --share 0.3 --rate-frac 0.7 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

from common import ROOT, add_run_args, stepserve
from edits_load import per_kind


class OnePipelinePerControl:
    """The baseline's executor: each step's batch split by control setting (the ControlNets its requests name, or
    none), each part one forward of its own, one after the other; the step costs their sum."""

    def __init__(self, inner) -> None:
        self.__dict__["inner"] = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value) -> None:
        setattr(self.inner, name, value)

    def denoise(self, requests) -> float:
        parts: dict[tuple, list] = {}
        for r in requests:
            parts.setdefault(tuple(c.name for c in (r.params.controls or ())), []).append(r)
        return sum(self.inner.denoise(part) for part in parts.values())


def per_control_run(argv: list[str]) -> None:
    """`stepserve bench` in this process, its model served through OnePipelinePerControl."""
    from stepserve.bench import live_bed
    from stepserve.bench.app import run_bench
    from stepserve.commands.bench import config_from_args, write_and_conclude

    cfg = config_from_args(argv)
    loader = live_bed.load_model
    live_bed.load_model = lambda c: OnePipelinePerControl(loader(c))
    try:
        write_and_conclude(asyncio.run(run_bench(cfg)), cfg.out)
    finally:
        live_bed.load_model = loader


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
    stepserve("bench", *common, "--mix", str(mixed), "--rate-frac", str(args.rate_frac), "--out",
              str(args.out / "control"))
    mixed_results = json.loads((args.out / "control" / "results.json").read_text())
    capacity = mixed_results["capacity"]["rps"]
    rate = args.rate_frac * capacity
    mixed_runs = mixed_results["runs"]
    stepserve("bench", *common, "--mix", str(plain), "--rate", f"{rate:.6f}", "--out", str(args.out / "plain"))
    plain_results = json.loads((args.out / "plain" / "results.json").read_text())
    per_control_run([*common, "--mix", str(mixed), "--rate", f"{rate:.6f}", "--out", str(args.out / "per-control")])
    baseline = per_kind(json.loads((args.out / "per-control" / "results.json").read_text())["runs"])["slo"]
    alone = plain_results["summaries"][0]
    table = per_kind(mixed_runs)["slo"]
    print(f"\n{rate:.2f} req/s ({args.rate_frac:.0%} of the capacity with controls, {capacity:.2f} req/s); "
          f"{args.share:.0%} of requests carry one of {args.controlnets} ControlNets; medians over {args.repeats}")
    row = {"rate_rps": rate, "capacity_rps": capacity, "share": args.share,
           "plain_alone": {"p50": alone["p50_s"]["median"], "p95": alone["p95_s"]["median"]}, **table,
           "per_control_pipelines": baseline}
    for q in ("p50", "p95"):
        base, beside = row["plain_alone"][q], table["generation"][q]
        mine, theirs = table["controlled"][q], baseline["controlled"][q]
        print(f"plain {q}: alone {base * 1000:7.0f} ms, beside controlled requests {beside * 1000:7.0f} ms "
              f"({beside / base:.2f}x); controlled {q}: {mine * 1000:7.0f} ms, one pipeline per control "
              f"{theirs * 1000:7.0f} ms ({mine / theirs:.2f}x); plain there {baseline['generation'][q] * 1000:.0f} ms")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
