"""Edits mixed with generations under load: one Poisson trace in which half the requests are edits of pooled
images (image to image at strength 0.3-0.8; optionally some inpainting), served by each strategy in turn.

1. `stepserve bench` with the edit mix at --rate-frac of the reference contender's measured capacity, every
   contender on the identical trace, --repeats rounds with the contenders' order rotating (the bench's own).
2. p50 / p95 per kind (generations, image to image, inpainting): medians over the rounds, side by side, and each
   contender's ratio to the first one's.

    .venv/bin/python benchmarks/edits_load.py                              # embedded, continuous vs dynamic
    .venv/bin/python benchmarks/edits_load.py --strategies continuous,dynamic,slo --edit '{"none": 2, "image": 1, "inpaint": 1}'
"""

from __future__ import annotations

import argparse
import json
import statistics

from common import add_run_args, stepserve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/edits-load")
    p.add_argument("--strategies", default="continuous,dynamic")
    p.add_argument("--edit", default='{"none": 1, "image": 1}', help="the mix's edit field (JSON)")
    p.add_argument("--strength", default="[0.3, 0.4, 0.5, 0.6, 0.7, 0.8]", help="the mix's strength field (JSON)")
    p.add_argument("--size", default="32x32", help="the requests' size (the embedded model's)")
    p.add_argument("--rate-frac", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mix = args.out / "mix.json"
    mix.write_text(json.dumps({"steps": [int(s) for s in args.steps.split(",")], "size": args.size,
                               "edit": json.loads(args.edit), "strength": json.loads(args.strength)}))
    stepserve("bench", "--model", args.model, "--threads", str(args.threads), "--strategies", args.strategies,
              "--seed", str(args.seed), "--duration", str(args.duration), "--warmup", str(args.warmup),
              "--repeats", str(args.repeats), "--max-batch-size", str(args.max_batch_size), "--no-progress",
              "--mix", str(mix), "--rate-frac", str(args.rate_frac), "--out", str(args.out / "run"))
    results = json.loads((args.out / "run" / "results.json").read_text())
    table = per_kind(results["runs"])
    names = list(table)
    print(f"\n{args.model}, {results['load_description']}; edit {args.edit}, strength {args.strength}; "
          f"medians over {args.repeats} rounds")
    for kind in next(iter(table.values())):
        print(f"\n{kind}:")
        base = table[names[0]][kind]
        for name in names:
            row = table[name][kind]
            ratios = "  ".join(f"{q} {row[q] / base[q]:.2f}x" for q in ("p50", "p95") if base[q] and row[q])
            print(f"  {name:16} p50 {row['p50'] * 1000:7.0f} ms  p95 {row['p95'] * 1000:7.0f} ms  "
                  f"done {row['completed']}/{row['measured']}   vs {names[0]}: {ratios}")
    print(json.dumps({"capacity_rps": results["capacity"]["rps"], "per_kind": table}))


def per_kind(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """{contender: {kind: {p50, p95 (medians over rounds), completed, measured (summed)}}}."""
    out: dict[str, dict[str, dict]] = {}
    for run in runs:
        for k in run["latency_by_kind"]:
            cell = out.setdefault(run["contender"], {}).setdefault(k["kind"], {"p50s": [], "p95s": [],
                                                                                "completed": 0, "measured": 0})
            cell["p50s"].append(k["latency"]["p50"])
            cell["p95s"].append(k["latency"]["p95"])
            cell["completed"] += k["completed"]
            cell["measured"] += k["measured"]
    for kinds in out.values():
        for cell in kinds.values():
            for q in ("p50", "p95"):
                values = [v for v in cell.pop(q + "s") if v is not None]
                cell[q] = statistics.median(values) if values else None
    return out


if __name__ == "__main__":
    main()
