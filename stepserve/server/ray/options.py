"""`stepserve serve --replicas N`: how the replica flags (defined in commands/serve.py) map onto Ray Serve's
deployment options.

Nothing here imports Ray: the checks and the mapping are plain functions over the parsed flags, so a bad flag gets
its one-line error before a cluster starts (docs/SCALING.md lists the mapping).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace

from ...fleet.routers import serving_router
from ...util.words import plural

HAND_BACK_S = 15.0  # after the grace periods: aborting what is left, the engine's stop, handing jobs back


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
    memory_share: float = 1.0  # of its device's (or host's) free memory, each replica's budget for the memory cap
    # fleet/routers.py; power_of_two is Ray Serve's own. Unless told: least_work from 3 replicas up (the most
    # --autoscale may run), Ray's own with 1 or 2 (fleet.routers.serving_router)
    router: str = "power_of_two"
    adapter_load_s: float = 1.0  # the routers' price for loading an adapter a replica does not hold
    slo_s: float | None = None  # --slo-p95-ms: autoscale on the predicted backlog against it (fleet/autoscale.py)
    utilisation: float | None = None  # --autoscale-utilisation: with slo_s, how busy a replica may be (None: 0.8)

    @property
    def most_replicas(self) -> int:
        return self.autoscale[1] if self.autoscale else self.replicas


def plan_replicas(args: argparse.Namespace, local_cores: int, degrees=None) -> ReplicaPlan:
    """Check the replica flags against each other (and, for a local cluster, against this machine's cores).
    `degrees`: the parallel.degrees.Degrees each replica's engine runs at (None: one device)."""
    from ..startup import StartupError

    autoscale = args.autoscale
    replicas = args.replicas if args.replicas is not None else (autoscale[0] if autoscale else 1)
    if autoscale and not autoscale[0] <= replicas <= autoscale[1]:
        raise StartupError(f"--replicas {replicas} is outside --autoscale {autoscale[0]}:{autoscale[1]}; start "
                           f"with a count between MIN and MAX")
    if args.target_ongoing_requests is not None and not autoscale:
        raise StartupError("--target-ongoing-requests steers the autoscaler; add --autoscale MIN:MAX")
    world = degrees.world if degrees is not None else 1
    cpus, gpus = replica_devices(args, degrees)
    if gpus > 0 and args.device != "cuda":
        raise StartupError(f"--replica-gpus {gpus:g} reserves GPUs that --device {args.device} would leave idle; "
                           f"add --device cuda")
    if gpus == 0 and args.device == "cuda":
        raise StartupError("--device cuda needs --replica-gpus > 0: Ray hides the GPUs from a replica that reserves "
                           "none")
    plan = ReplicaPlan(
        replicas=replicas, autoscale=autoscale, cpus=cpus, gpus=gpus,
        threads=max(1, min(args.threads, math.floor(cpus / world))),  # each rank's
        max_ongoing_requests=args.max_ongoing_requests or 2 * args.max_batch_size,
        max_queued_requests=-1 if args.max_queued_requests is None else args.max_queued_requests,
        target_ongoing_requests=args.target_ongoing_requests or float(args.max_batch_size),
        grace_s=args.shutdown_grace_s, ray_address=args.ray_address)
    plan.router = getattr(args, "router", None) or serving_router(plan.most_replicas)
    plan.adapter_load_s = getattr(args, "adapter_load_s", None) or plan.adapter_load_s
    slo_ms = getattr(args, "slo_p95_ms", None)
    if slo_ms is not None:
        if not autoscale:
            raise StartupError("--slo-p95-ms steers the autoscaler; add --autoscale MIN:MAX")
        if args.target_ongoing_requests is not None:
            raise StartupError("--slo-p95-ms and --target-ongoing-requests are two autoscaling policies; give one")
        plan.slo_s = slo_ms / 1000.0
    plan.utilisation = getattr(args, "autoscale_utilisation", None)
    if plan.utilisation is not None and not 0 < plan.utilisation <= 1:
        raise StartupError(f"--autoscale-utilisation: a fraction in (0, 1], got {plan.utilisation:g}")
    if plan.utilisation is not None and plan.slo_s is None:
        raise StartupError("--autoscale-utilisation steers the SLO autoscaling policy; add --slo-p95-ms MS and "
                           "--autoscale MIN:MAX")
    plan.memory_share = memory_share(plan, args.device)
    if plan.memory_share < 1 and not getattr(args, "no_memory_cap", False):
        plan.notes.append(f"each replica's memory cap counts on {plan.memory_share:.0%} of the free "
                          f"{'GPU' if args.device.startswith('cuda') else 'host'} memory: replicas share it")
    if plan.threads < args.threads:
        ranks = f" over its {world} ranks" if world > 1 else ""
        plan.notes.append(f"--threads {args.threads} lowered to {plan.threads}: a replica runs on at most its "
                          f"--replica-cpus {cpus:g}{ranks}")
    if world > 1:
        kind = "GPU" if gpus else "CPU"
        plan.notes.append(f"each replica runs {degrees.describe()}: {world} ranks, one {kind} each; "
                          f"{plan.most_replicas} x {world} = {plan.most_replicas * world} {kind}s in all")
    if args.ray_address is None and plan.most_replicas * cpus > local_cores:
        lower = "the replica count or the degrees" if world > 1 else \
            "--replica-cpus (fractions allowed) or the replica count"
        raise StartupError(f"{plural(plan.most_replicas, 'replica')} at {plural(cpus, 'CPU')} each: "
                           f"{plan.most_replicas * cpus:g} CPUs in all, but this machine has {local_cores}; lower "
                           f"{lower}, or join a larger cluster with --ray-address")
    return plan


def replica_devices(args: argparse.Namespace, degrees) -> tuple[float, float]:
    """(CPUs, GPUs) Ray reserves for each replica. A replica at a parallel degree owns its ranks' devices: one GPU
    per rank with --device cuda (the ranks see exactly those), one CPU per rank's process; --replica-gpus then
    must be the ranks' count, and --replica-cpus at least it."""
    from ..startup import StartupError

    world = degrees.world if degrees is not None else 1
    cpus = float(world) if args.replica_cpus is None else args.replica_cpus
    gpus = (float(world) if args.device == "cuda" else 0.0) if args.replica_gpus is None else args.replica_gpus
    if world == 1:
        return cpus, (0.0 if args.replica_gpus is None else args.replica_gpus)
    if args.replica_gpus is not None and args.device == "cuda" and gpus != world:
        raise StartupError(f"--replica-gpus {gpus:g}: a replica at {degrees.describe()} runs {world} ranks, one GPU "
                           f"each; give {world} (or leave it out: it follows the degree)")
    if cpus < world:
        raise StartupError(f"--replica-cpus {cpus:g}: a replica at {degrees.describe()} runs {world} rank "
                           f"processes, one CPU each; give at least {world} (or leave it out: it follows the degree)")
    return cpus, gpus


def memory_share(plan: ReplicaPlan, device: str) -> float:
    """How much of the free memory one replica's memory cap may count on: replicas that can land on one GPU
    (--replica-gpus below 1) or one host (the CPU device) split it, so that together they stay within it. On CPU
    all replicas (the most the autoscaler may start) are taken to share one host, the worst case."""
    if device.startswith("cuda"):
        if plan.gpus >= 1:
            return 1.0
        return 1.0 / max(1, min(plan.most_replicas, math.floor(1.0 / plan.gpus + 1e-9)))
    return 1.0 / plan.most_replicas


def replica_settings(settings, plan: ReplicaPlan):
    """ServeSettings for the replicas: each engine's memory cap takes its share of the memory."""
    return replace(settings, engine=replace(settings.engine, memory_share=plan.memory_share))


def stop_budget_s(plan: ReplicaPlan) -> float:
    """How long Ray gives a stopping replica before it kills it (graceful_shutdown_timeout_s). A replica stops as
    one server does on SIGTERM: requests in flight get the grace period, then the app's lifespan shutdown gives the
    engine's remaining work (jobs among it) the grace period again, aborts what is left and hands unfinished jobs
    back to the state store. Killed before that, its jobs would wait out their leases."""
    return 2 * plan.grace_s + HAND_BACK_S


def deployment_options(plan: ReplicaPlan) -> dict:
    """Keyword arguments for `ray.serve.deployment(...)`."""
    options = {
        "ray_actor_options": {"num_cpus": plan.cpus, "num_gpus": plan.gpus},
        "max_ongoing_requests": plan.max_ongoing_requests,
        "max_queued_requests": plan.max_queued_requests,
        # Ray's own queue limit answers like our admission control: 429 with Retry-After (Ray's default is 503).
        "backpressure_config": {"status_code": 429, "retry_after_s": 1},
        "graceful_shutdown_timeout_s": stop_budget_s(plan),
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    if plan.autoscale:
        low, high = plan.autoscale
        options["autoscaling_config"] = {"min_replicas": low, "max_replicas": high,
                                         "initial_replicas": plan.replicas,
                                         "target_ongoing_requests": plan.target_ongoing_requests}
        if plan.slo_s is not None:  # our policy on the replicas' work in hand; its own delays, not Ray's
            from .fleet import LOOK_BACK_S, POLICY_FUNCTION

            options["autoscaling_config"].update(
                policy={"policy_function": POLICY_FUNCTION,
                        "policy_kwargs": {"slo_s": plan.slo_s, "low": low, "high": high,
                                          **({"utilisation": plan.utilisation} if plan.utilisation else {})}},
                upscale_delay_s=0.0, downscale_delay_s=0.0, look_back_period_s=LOOK_BACK_S)
    else:
        options["num_replicas"] = plan.replicas
    config = _router_config(plan)
    if config is not None:
        options["request_router_config"] = config
    return options


def _router_config(plan: ReplicaPlan) -> dict | None:
    """Ray Serve's request_router_config for the plan's router (None: Ray's own power of two choices)."""
    if plan.router == "power_of_two":
        return None
    from .router import router_config  # imports Ray Serve's router API, as the deployment does

    return router_config(plan.router, plan.adapter_load_s)
