"""`stepserve plan --devices D`: how to spend D devices on one model (stepserve.sim.split_plan); the flags are
`stepserve plan`'s (commands/plan.py parses them)."""

from __future__ import annotations

import json
import sys

from ..costs.degree import degree_label
from ..util.words import plural

PLAN_JSON = "plan.json"


def plan_devices(spec, described: str, args) -> int:
    """Print the table of the splits that use every device at each rate, then the cheapest split per rate; write
    plan.json to --out."""
    from ..sim.split_plan import (
        SplitProbe,
        cheapest,
        choice_line,
        full_splits,
        full_splits_table,
        simulate_split,
        to_json,
    )

    models, devices, strategy = args.models, args.devices, spec.strategies[0]
    degrees = ", ".join(f"{n} ({degree_label(m)})" for n, m in models.items())
    print(f"plan: {plural(devices, 'device')}, p95 <= {spec.slo_s:g} s, {strategy}, router {spec.router}, {described}, "
          f"{spec.duration_s:g} s per simulation, seed {spec.seed}; devices per replica: {degrees}", file=sys.stderr)

    def note(rate: float):
        def line(split, probe) -> None:  # each split the search for the cheapest one tries
            mark = "stopped early" if probe.stopped_early else f"p95 {probe.p95_s:.2f} s"
            print(f"  {rate:g} req/s, {split.label}: {mark}, {'holds' if probe.held else 'misses'}",
                  file=sys.stderr)
        return None if args.no_progress else line

    splits = full_splits(devices, list(models))
    probes: list[SplitProbe] = [simulate_split(spec, models, sp, rate, strategy)
                                for rate in args.rates for sp in splits]
    choices = [cheapest(spec, models, devices, rate, strategy, note(rate)) for rate in args.rates]
    if splits:
        print(f"Every split of {plural(devices, 'device')} ({', '.join(s.label for s in splits)}: replicas x devices "
              f"per replica), {strategy}, p95 <= {spec.slo_s:g} s:")
        print(full_splits_table(probes, spec.slo_s))
        print()
    print(f"The fewest devices that hold p95 <= {spec.slo_s:g} s (at most {devices}):")
    print("\n".join(choice_line(c, devices, spec.slo_s) for c in choices))
    args.out.mkdir(parents=True, exist_ok=True)
    data = to_json(probes, choices, devices)
    data["settings"] = {"rates_rps": args.rates, "slo_p95_s": spec.slo_s, "strategy": strategy, "router": spec.router,
                        "duration_s": spec.duration_s, "warmup_s": spec.warmup_s, "seed": spec.seed,
                        "max_batch_size": spec.max_batch_size, "mix": described,
                        "latency_model_files": [str(p) for p in args.latency_model]}
    (args.out / PLAN_JSON).write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {args.out / PLAN_JSON}")
    return 0
