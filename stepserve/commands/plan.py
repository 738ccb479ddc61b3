"""`stepserve plan`: how many replicas hold a p95 latency SLO at a request rate, per batching strategy, found by
simulating replicas behind a router on a measured latency model (no hardware needed).

    stepserve plan --latency-model latency.json --rate 20 --slo-p95-ms 400
    stepserve plan --latency-model latency.json --rate 50 --slo-p95-ms 800 --strategy continuous,dynamic,static \\
        --mix mix.yaml --router power_of_two --out plan-out

Each strategy's answer is the fewest replicas whose simulated p95 (refused and unfinished requests counting as
infinitely late) is within the SLO on a seeded Poisson trace at --rate; the search climbs 1, 2, 4, ... then
bisects. Writes plan.json and p95_vs_replicas.png to --out.

With --devices D, the question is how to spend D devices: R replicas of degree N (each request split over N
devices, R x N <= D), one latency model per degree (each file says its degree: `stepserve profile
--ulysses-degree N`, or the per-degree GPU curves). It prints every split that uses all D devices at each rate
(p95 and goodput), and per rate the split that holds the SLO with the fewest devices (stepserve.sim.split_plan;
degree N searches up to D / N replicas, in place of --max-replicas):

    stepserve plan --devices 8 --latency-model stepserve/models/latency/gpu-1024-compute-bound*.json \
        --rate 0.4,0.8,1.4 --slo-p95-ms 3000 --steps 28
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..scheduling import STRATEGIES
from ..sim.plan import DEFAULT_STRATEGIES
from ..fleet.routers import PLANNING_ROUTER, ROUTERS
from ..util.words import plural
from .flags import DefaultsHelpFormatter

PLAN_JSON = "plan.json"
PLOT = "p95_vs_replicas.png"


class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not argparse's usage block
        raise UsageError(message)


def build_parser() -> _Parser:
    p = _Parser(prog="stepserve plan", description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--latency-model", required=True, nargs="+", action="extend", metavar="FILE",
                   help="latency model file (from `stepserve profile`); with --devices, one per degree")
    p.add_argument("--rate", required=True, help="offered load, requests per second (Poisson arrivals); with "
                                                 "--devices, several comma-separated")
    p.add_argument("--devices", help="plan the split of this many devices: R replicas of degree N, R x N <= D")
    p.add_argument("--slo-p95-ms", required=True, help="the p95 latency to hold, milliseconds from arrival")
    p.add_argument("--strategy", "--strategies", dest="strategy", default=None,
                   help=f"strategies to plan, comma-separated (default: {','.join(DEFAULT_STRATEGIES)}; with "
                        f"--devices one, default {DEFAULT_STRATEGIES[0]}); allowed: {', '.join(STRATEGIES)}")
    mix = p.add_mutually_exclusive_group()
    mix.add_argument("--steps", default="8,20,40", help="step counts drawn uniformly (when no --mix)")
    mix.add_argument("--mix", type=Path, help="request mix file (YAML or JSON), as `stepserve bench --mix`")
    p.add_argument("--router", default=PLANNING_ROUTER,
                   help=f"how requests are spread over the replicas (default {PLANNING_ROUTER}: where each is "
                        f"predicted to finish first; docs/SCALING.md); allowed: {', '.join(ROUTERS)}")
    p.add_argument("--max-replicas", default="64", help="give up above this many replicas (default 64)")
    p.add_argument("--duration", default="120", help="seconds of arrivals per simulation (default 120)")
    p.add_argument("--warmup", default="0", help="first seconds of arrivals served but not counted (default 0)")
    p.add_argument("--seed", default="0", help="seeds the trace and the router's draws (default 0)")
    p.add_argument("--max-batch-size", default="8", help="every engine's max batch size (default 8)")
    p.add_argument("--timeout-slo", action="store_true",
                   help="every request carries the SLO as its deadline (what the slo strategy acts on)")
    p.add_argument("--out", type=Path, default=Path("plan-out"), help="output folder (default plan-out)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar or lines")
    return p


def _number(text: str, flag: str, kind=float, low: float = 0.0, strict: bool = True):
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value) or (value <= low if strict else value < low):
        raise UsageError(f"{flag}: must be {'>' if strict else '>='} {low:g}, got {text}")
    return value


def parse(argv: list[str]):
    """(PlanSpec, mix description) from a command line; a bad flag raises UsageError with one line."""
    from ..bench.workload import Mix
    from ..costs import LatencyModel
    from ..sim.plan import PlanSpec
    from ..sim.split_plan import by_degree

    a = build_parser().parse_args(argv)
    a.devices = None if a.devices is None else _number(a.devices, "--devices", int)
    rates = [_number(r, "--rate") for r in a.rate.split(",")]
    if len(rates) > 1 and a.devices is None:
        raise UsageError(f"--rate: one rate (several, comma-separated, only with --devices); got {a.rate}")
    a.rates, rate = rates, rates[0]
    slo_ms = _number(a.slo_p95_ms, "--slo-p95-ms")
    default = DEFAULT_STRATEGIES[:1] if a.devices else DEFAULT_STRATEGIES
    strategies = [s.strip() for s in (a.strategy or ",".join(default)).split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise UsageError(f"--strategy: {', '.join(bad) or 'empty'} not supported; allowed: {', '.join(STRATEGIES)}")
    if a.devices and len(strategies) > 1:
        raise UsageError(f"--strategy: --devices plans one strategy; got {', '.join(strategies)}")
    if not a.devices and len(a.latency_model) > 1:
        raise UsageError(f"--latency-model: one file (several, one per degree, only with --devices); got "
                         f"{len(a.latency_model)}")
    if a.router not in ROUTERS:
        raise UsageError(f"--router: {a.router!r} is not supported; allowed: {', '.join(ROUTERS)}")
    if a.mix is not None:
        try:
            mix, described = Mix.load(a.mix), f"mix {a.mix}"
        except (OSError, ValueError) as exc:
            raise UsageError(f"--mix: {exc}") from None
    else:
        steps = [_number(s, "--steps", int) for s in a.steps.split(",") if s.strip()]
        if not steps:
            raise UsageError("--steps: give step counts, e.g. 8,20,40")
        mix, described = Mix.from_steps(steps), f"steps {','.join(map(str, steps))} (uniform)"
    try:
        models = [LatencyModel.load(path) for path in a.latency_model]
        a.models = by_degree(models)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--latency-model: {exc}") from None
    if a.devices and not any(n <= a.devices for n in a.models):
        raise UsageError(f"--devices {a.devices}: every latency model holds more devices per replica "
                         f"({', '.join(map(str, a.models))})")
    latency = models[0]
    try:
        spec = PlanSpec(latency, rate, slo_ms / 1000.0, mix, strategies, a.router,
                        _number(a.max_replicas, "--max-replicas", int), _number(a.duration, "--duration"),
                        _number(a.warmup, "--warmup", strict=False),
                        seed=_number(a.seed, "--seed", int, strict=False),
                        max_batch_size=_number(a.max_batch_size, "--max-batch-size", int),
                        timeout_s=slo_ms / 1000.0 if a.timeout_slo else None)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return spec, described, a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(x in ("-h", "--help") for x in argv):
        build_parser().print_help()
        return 0
    try:
        spec, described, args = parse(argv)
    except UsageError as exc:
        print(f"stepserve plan: {exc}", file=sys.stderr)
        return 2
    if args.devices:
        from .plan_devices import plan_devices

        return plan_devices(spec, described, args)
    from ..costs.degree import degree_label, devices_of
    from ..util.progress import is_terminal, progress
    from ..sim.plan import (
        probe_lines,
        run_plan,
        simulate_fleet,
        table,
        to_json,
        trace_arrivals,
    )
    from ..sim.plan_plot import plot_p95_vs_replicas

    total = len(trace_arrivals(spec))
    print(f"plan: {spec.rate_rps:g} req/s, p95 <= {spec.slo_s * 1000:g} ms, router {spec.router}, {described}, "
          f"{spec.duration_s:g} s per simulation ({plural(total, 'request')}), seed {spec.seed}", file=sys.stderr)
    per_replica = devices_of(spec.latency)
    if per_replica > 1:
        print(f"stepserve plan: note: the latency model was measured at {degree_label(spec.latency)}: each replica "
              f"holds {per_replica} devices", file=sys.stderr)
    if "slo" in spec.strategies and spec.timeout_s is None:
        print("stepserve plan: note: no request carries a deadline (--timeout-slo), so slo refuses nothing and "
              "gives up on nothing: it is cost-aware continuous batching, first come first served", file=sys.stderr)

    def probe(strategy: str, n: int, stop_early: bool):
        # a live bar on a terminal; elsewhere only the result line below
        bar = progress(total, f"{strategy} x{n}", "request", disable=args.no_progress or not is_terminal(sys.stderr),
                       leave=False)
        with bar:
            _, p = simulate_fleet(spec, strategy, n, stop_early, on_progress=bar.update)
        if not args.no_progress:
            p95 = f"> {spec.slo_s * 1000:g} ms (stopped early)" if p.stopped_early else (
                f"{p.p95_s * 1000:.1f} ms" if math.isfinite(p.p95_s) else "inf")
            print(f"  {strategy} x{n}: p95 {p95}, {'holds' if p.held else 'misses'} [{p.wall_s:.1f} s]",
                  file=sys.stderr)
        return p

    try:
        plans = run_plan(spec, probe)
    except (ValueError, RuntimeError) as exc:
        print(f"stepserve plan: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    data = to_json(spec, plans, described)
    data["settings"]["latency_model_file"] = str(args.latency_model[0])
    (args.out / PLAN_JSON).write_text(json.dumps(data, indent=2) + "\n")
    plot_p95_vs_replicas(spec, plans, args.out / PLOT)
    print(table(spec, plans))
    print()
    print("\n".join(probe_lines(p, spec.slo_s) for p in plans))
    print(f"\nwrote {args.out / PLAN_JSON} and {args.out / PLOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
