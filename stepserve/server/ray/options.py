"""`stepserve serve --replicas N`: the replica flags and how they map onto Ray Serve's deployment options.

Nothing here imports Ray: the parser, the checks and the mapping are plain functions over the parsed flags, so a
bad flag gets its one-line error before a cluster starts (docs/SCALING.md lists the mapping).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from ...arg_types import float_from, int_from

_count = int_from
_amount = float_from


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
    g = p.add_argument_group("replicas (Ray Serve; see docs/SCALING.md)")
    g.add_argument("--replicas", type=_count(1), default=None, metavar="N",
                   help="serve N engines as a Ray Serve deployment behind Ray's HTTP proxy on --host:--port (with "
                        "--autoscale: the replicas to start with)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. 127.0.0.1:6379 or 'auto'); default: start a local one on "
                        "loopback and stop it on exit")
    g.add_argument("--autoscale", type=parse_autoscale, default=None, metavar="MIN:MAX",
                   help="let Ray Serve's autoscaler keep between MIN and MAX replicas")
    g.add_argument("--target-ongoing-requests", type=_amount(0.0, False, "a positive number"), default=None,
                   help="autoscaling: the requests in flight per replica Ray Serve aims for (default: "
                        "--max-batch-size)")
    g.add_argument("--replica-cpus", type=_amount(0.0, False, "a positive number of CPUs (fractions allowed)"),
                   default=None, help="CPUs Ray reserves for each replica (default 1); torch then runs on at most "
                                      "that many threads (at least 1)")
    g.add_argument("--replica-gpus", type=_amount(0.0, True, "a number of GPUs >= 0 (fractions allowed)"),
                   default=None, help="GPUs Ray reserves for each replica (default 0; > 0 needs --device cuda)")
    g.add_argument("--max-ongoing-requests", type=_count(1), default=None,
                   help="requests Ray sends one replica at once (default: 2 x --max-batch-size: a batch running "
                        "and one waiting); more wait in Ray's queue")
    g.add_argument("--max-queued-requests", type=_count(0), default=None,
                   help="requests Ray's router holds while every replica is at --max-ongoing-requests; beyond it "
                        "429 + Retry-After (default: unbounded)")


@dataclass
class ReplicaPlan:
    """What the replica flags ask Ray Serve for (plain data: it travels to the cluster with the deployment)."""

    replicas: int
    autoscale: tuple[int, int] | None
    cpus: float
    gpus: float
    threads: int
    max_ongoing_requests: int
    max_queued_requests: int  # -1: unbounded, as in Ray Serve
    target_ongoing_requests: float
    grace_s: float
    ray_address: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def most_replicas(self) -> int:
        return self.autoscale[1] if self.autoscale else self.replicas


def plan_replicas(args: argparse.Namespace, local_cores: int) -> ReplicaPlan:
    """Check the replica flags against each other (and, for a local cluster, against this machine's cores)."""
    from ..startup import StartupError

    autoscale = args.autoscale
    replicas = args.replicas if args.replicas is not None else (autoscale[0] if autoscale else 1)
    if autoscale and not autoscale[0] <= replicas <= autoscale[1]:
        raise StartupError(f"--replicas {replicas} is outside --autoscale {autoscale[0]}:{autoscale[1]}; start "
                           f"with a count between MIN and MAX")
    if args.target_ongoing_requests is not None and not autoscale:
        raise StartupError("--target-ongoing-requests steers the autoscaler; add --autoscale MIN:MAX")
    cpus = 1.0 if args.replica_cpus is None else args.replica_cpus
    gpus = 0.0 if args.replica_gpus is None else args.replica_gpus
    if gpus > 0 and args.device != "cuda":
        raise StartupError(f"--replica-gpus {gpus:g} reserves GPUs that --device {args.device} would leave idle; "
                           f"add --device cuda")
    if gpus == 0 and args.device == "cuda":
        raise StartupError("--device cuda needs --replica-gpus > 0: Ray hides the GPUs from a replica that reserves "
                           "none")
    plan = ReplicaPlan(
        replicas=replicas, autoscale=autoscale, cpus=cpus, gpus=gpus,
        threads=max(1, min(args.threads, math.floor(cpus))),
        max_ongoing_requests=args.max_ongoing_requests or 2 * args.max_batch_size,
        max_queued_requests=-1 if args.max_queued_requests is None else args.max_queued_requests,
        target_ongoing_requests=args.target_ongoing_requests or float(args.max_batch_size),
        grace_s=args.shutdown_grace_s, ray_address=args.ray_address)
    if plan.threads < args.threads:
        plan.notes.append(f"--threads {args.threads} lowered to {plan.threads}: a replica runs on at most its "
                          f"--replica-cpus {cpus:g}")
    if args.ray_address is None and plan.most_replicas * cpus > local_cores:
        raise StartupError(f"{plan.most_replicas} replicas x {cpus:g} CPUs need {plan.most_replicas * cpus:g} CPUs "
                           f"but this machine has {local_cores}; lower --replica-cpus (fractions allowed) or the "
                           f"replica count, or join a larger cluster with --ray-address")
    return plan


def deployment_options(plan: ReplicaPlan) -> dict:
    """Keyword arguments for `ray.serve.deployment(...)`."""
    options = {
        "ray_actor_options": {"num_cpus": plan.cpus, "num_gpus": plan.gpus},
        "max_ongoing_requests": plan.max_ongoing_requests,
        "max_queued_requests": plan.max_queued_requests,
        # Ray's own queue limit answers like our admission control: 429 with Retry-After (Ray's default is 503).
        "backpressure_config": {"status_code": 429, "retry_after_s": 1},
        "graceful_shutdown_timeout_s": plan.grace_s,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if plan.autoscale:
        low, high = plan.autoscale
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high,
                                         "initial_replicas": plan.replicas,
                                         "target_ongoing_requests": plan.target_ongoing_requests}
    else:
        options["num_replicas"] = plan.replicas
    return options
