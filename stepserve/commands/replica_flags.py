"""The flags of `stepserve serve --replicas N` (Ray Serve replicas; server/ray/options.py maps them onto Ray Serve's
options), and whether a command line asks for replicas at all."""

from __future__ import annotations

import argparse

from ..fleet.routers import ROUTERS
from ..server.startup import StartupError
from .flags import float_from, int_from


def parse_autoscale(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high)) if sep else None
    except ValueError:
        bounds = None
    if bounds is None or not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, two integers with 1 <= MIN <= MAX (e.g. 1:4), got "
                                         f"{text!r}")
    return bounds


def add_replica_flags(p: argparse.ArgumentParser) -> None:
    """The flags of `--replicas N` (server/ray/options.py maps them onto Ray Serve's options)."""
    g = p.add_argument_group("replicas (Ray Serve; see docs/SCALING.md)")
    g.add_argument("--replicas", type=int_from(1), default=None, metavar="N",
                   help="serve N engines as a Ray Serve deployment behind Ray's HTTP proxy on --host:--port (with "
                        "--autoscale: the replicas to start with)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. 127.0.0.1:6379 or 'auto'); default: start a local one on "
                        "loopback and stop it on exit")
    g.add_argument("--autoscale", type=parse_autoscale, default=None, metavar="MIN:MAX",
                   help="let Ray Serve's autoscaler keep between MIN and MAX replicas")
    g.add_argument("--target-ongoing-requests", type=float_from(0.0, False, "a positive number"), default=None,
                   help="autoscaling: the requests in flight per replica Ray Serve aims for (default: "
                        "--max-batch-size)")
    g.add_argument("--slo-p95-ms", type=float_from(0.0, False, "a positive number of milliseconds"), default=None,
                   help="autoscaling on the replicas' predicted work in hand against this p95, instead of a count "
                        "of requests (docs/SCALING.md)")
    g.add_argument("--autoscale-utilisation", type=float_from(0.0, False, "a fraction in (0, 1]"), default=None,
                   metavar="U", help="with --slo-p95-ms: how busy a replica may be before another starts (default "
                                     "0.8); lower starts replicas sooner and keeps more through a lull")
    g.add_argument("--router", default=None, choices=ROUTERS,
                   help="how Ray Serve spreads requests over the replicas (default: least_work, where each is "
                        "predicted to finish first, with 3 replicas or more (the --autoscale MAX); power_of_two, "
                        "Ray's own, with 1 or 2; docs/SCALING.md)")
    g.add_argument("--adapter-load-s", type=float_from(0.0, True, "a number of seconds >= 0"), default=None,
                   help="least_work: what loading a LoRA adapter costs a replica that does not hold it (default 1)")
    g.add_argument("--replica-cpus", type=float_from(0.0, False, "a positive number of CPUs (fractions allowed)"),
                   default=None, help="CPUs Ray reserves for each replica (default 1, or N at a parallel degree of N "
                                      "ranks); torch then runs on at most that many threads (at least 1)")
    g.add_argument("--replica-gpus", type=float_from(0.0, True, "a number of GPUs >= 0 (fractions allowed)"),
                   default=None, help="GPUs Ray reserves for each replica (default 0; > 0 needs --device cuda; at a parallel degree "
                        "of N ranks on CUDA: N, one per rank)")
    g.add_argument("--max-ongoing-requests", type=int_from(1), default=None,
                   help="requests Ray sends one replica at once (default: 2 x --max-batch-size: a batch running "
                        "and one waiting); more wait in Ray's queue")
    g.add_argument("--max-queued-requests", type=int_from(0), default=None,
                   help="requests Ray's router holds while every replica is at --max-ongoing-requests; beyond it "
                        "429 + Retry-After (default: unbounded)")


def replica_mode(args: argparse.Namespace) -> bool:
    """Ray Serve replicas (stepserve/server/ray/deployment.py) instead of one process; replica flags need it."""
    if args.replicas is not None or args.autoscale is not None or args.ray_address is not None:
        return True
    alone = [flag for flag, value in (("--replica-cpus", args.replica_cpus), ("--replica-gpus", args.replica_gpus),
                                      ("--max-ongoing-requests", args.max_ongoing_requests),
                                      ("--max-queued-requests", args.max_queued_requests),
                                      ("--target-ongoing-requests", args.target_ongoing_requests),
                                      ("--slo-p95-ms", args.slo_p95_ms), ("--router", args.router),
                                      ("--autoscale-utilisation", args.autoscale_utilisation),
                                      ("--adapter-load-s", args.adapter_load_s))
             if value is not None]
    if alone:
        raise StartupError(f"{', '.join(alone)} only apply to Ray Serve replicas; add --replicas N (or --autoscale "
                           f"MIN:MAX)")
    return False
