"""`stepserve bench`: load-test the batching strategies (in process) or a running server (HTTP); write a report.

    stepserve bench --model embedded --steps 8,20,40 --rate-frac 0.7 --duration 30 --out bench-out
    stepserve bench --target http://127.0.0.1:8000 --load closed --users 16
    stepserve bench --target triton=grpc://127.0.0.1:8001 --rate 5   # a Triton model `pipeline` (KServe v2)
    stepserve bench --model embedded --timeout-slo --strategies continuous,slo   # deadline = the SLO
    stepserve bench --peers triton,ray,litserve   # stepserve serve vs peer servers on loopback, same trace

Strategies: every one by default (slo, the default strategy, first in the report); without deadlines
(--timeout-s, --timeout-slo, a trace's slo_ms) slo refuses nothing and serves in arrival order.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from ..bench.app import run_bench, write_outputs
from ..bench.config import BenchConfig
from ..bench.remote import check_reachable
from ..bench.report_format import plain
from ..bench.targets import Contender
from ..bench.triton_target import is_triton_target, parse_triton_target
from ..bench.workload import Mix
from ..util.interrupts import INTERRUPTED, sigterm_as_ctrl_c
from ..util.words import noun_for, plural
from ..scheduling import DEFAULT_STRATEGY, STRATEGIES
from .bench_flags import UsageError, build_parser, number_list
from .flags import fast_path_from_args, model_of, weights_from_args

def contenders_from(args: argparse.Namespace) -> list[Contender]:
    if args.strategies is None and args.peers:
        names = [DEFAULT_STRATEGY]  # stepserve serve as it starts by default
    elif args.strategies is None:
        names = list(STRATEGIES)
    else:
        names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [n for n in names if n not in STRATEGIES]
    if bad or not names:
        raise UsageError(f"--strategies: {', '.join(bad) or 'nothing'} not supported; allowed: {', '.join(STRATEGIES)}")
    delays = number_list(args.dynamic_delays_ms, "--dynamic-delays-ms", positive=False)
    if any(d < 0 for d in delays):
        raise UsageError("--dynamic-delays-ms: delays must be >= 0")
    out: list[Contender] = []
    for name in dict.fromkeys(names):
        settings = dict(strategy=name, max_batch_size=args.max_batch_size, static_batch_size=args.static_batch_size,
                        max_queue=args.max_queue)
        if name == "dynamic":
            out += [Contender(max_queue_delay_ms=d, **settings) for d in delays]
        else:
            out.append(Contender(**settings))
    return out


def config_from_args(argv: list[str], command: str = "bench") -> BenchConfig:
    """Parse and check bench flags. `command` "simulate": --latency-model is the simulator's cost model (any
    strategy) and the bench-only checks on it are left to `stepserve simulate`."""
    args = build_parser(f"stepserve {command}").parse_args(argv)
    positive = {"--max-batch-size": args.max_batch_size, "--users": args.users, "--duration": args.duration,
                "--repeats": args.repeats, "--rate": args.rate, "--rate-frac": args.rate_frac,
                "--threads": args.threads, "--static-batch-size": args.static_batch_size,
                "--max-queue": args.max_queue, "--slo-p95-ms": args.slo_p95_ms, "--slo-x-idle": args.slo_x_idle,
                "--capacity-duration": args.capacity_duration, "--sweep-start-frac": args.sweep_start_frac,
                "--sweep-max-frac": args.sweep_max_frac, "--sweep-duration": args.sweep_duration}
    if args.sweep_factor <= 1 or args.sweep_refine < 0 or args.sweep_min_requests < 0:
        raise UsageError("--sweep-factor: must be > 1; --sweep-refine, --sweep-min-requests: must be >= 0")
    for flag, value in positive.items():
        if value is not None and not value > 0:
            raise UsageError(f"{flag}: must be > 0, got {value:g}")
    if args.warmup < 0 or (args.drain is not None and args.drain < 0):
        raise UsageError("--warmup/--drain: must be >= 0 seconds")
    if args.load == "trace" and args.trace is None:
        raise UsageError("--load trace needs --trace FILE (CSV or JSONL: offset_s, prompt, ...)")
    if args.trace is not None and args.load != "trace":
        raise UsageError("--trace FILE goes with --load trace")
    if args.target and args.model != "embedded":
        raise UsageError("--target and --model exclude each other: benchmark a server or an in-process model")
    if args.timeout_s is not None and not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise UsageError(f"--timeout-s: must be a number of seconds > 0 (every request's deadline), "
                         f"got {args.timeout_s:g}; for no deadline leave it out")
    for text in args.target:
        if is_triton_target(text):
            try:
                parse_triton_target(text)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    contenders = contenders_from(args)
    peers = _peers(args, argv, command) if args.peers is not None else []
    quality = getattr(args, "quality", False)
    if quality and (args.target or peers or args.model == "fake"):
        raise UsageError("--quality compares images with uncached ones made by the same in-process model: not with "
                         "--target, --peers or --model fake")
    for flag in ("lora_dir", "controlnet_dir", "ip_adapter_dir"):
        if getattr(args, flag, None) and (args.target or peers or args.model == "fake"):
            name = "--" + flag.replace("_", "-")
            raise UsageError(f"{name} loads into the in-process model: not with --target, --peers or --model fake "
                             f"(start the server with {name} instead)")
    if args.latency_model is not None and command == "bench":
        if args.target:
            raise UsageError("--latency-model is for in-process slo contenders; a --target server has its own")
        if not any(c.strategy == "slo" for c in contenders):
            raise UsageError("--latency-model goes with the slo strategy: add slo to --strategies")
        if not args.latency_model.is_file():
            raise UsageError(f"--latency-model: {args.latency_model} is not a file")
    try:
        mix = Mix.load(args.mix) if args.mix else Mix.from_steps([int(s) for s in number_list(args.steps, "--steps")])
    except (OSError, ValueError) as exc:
        raise UsageError(f"--mix/--steps: {exc}") from None
    if mix.videos and (args.target or peers):
        raise UsageError("a mix with `frames` (video requests) runs in process: the images endpoint of --target and "
                         "the peers make images; drop the mix's frames field (or --target/--peers)")
    conditioned = [f for f in ("edit", "control", "ip_adapter") if set(getattr(mix, f).values) - {None, "none"}]
    if peers and conditioned:
        raise UsageError(f"--peers: the peers serve text to image only; drop the mix's {' and '.join(conditioned)} "
                         f"field (or --peers)")
    model = model_of(args) if command == "bench" else args.model
    if command == "bench" and not args.target and model != "fake":
        from ..deploy.onnx_cache import serving_model

        try:  # on onnxruntime a diffusers folder runs as its ONNX export, made once into a cache
            model = serving_model(model, args.backend)
        except (OSError, ValueError) as exc:
            raise UsageError(str(exc)) from None
    return BenchConfig(
        argv=[command, *argv], mix=mix, out=args.out, targets=list(args.target), model=model,
        device=args.device, dtype=args.dtype, backend=args.backend, contenders=contenders, load=args.load,
        fast_path=fast_path_from_args(args) if command == "bench" else None,
        weights=weights_from_args(args) if command == "bench" else None,
        rate=args.rate,
        rate_frac=args.rate_frac, users=args.users, trace_file=str(args.trace) if args.trace else None,
        duration_s=args.duration, warmup_s=args.warmup, drain_s=args.drain, sweep=args.sweep,
        sweep_rates=number_list(args.sweep_rates, "--sweep-rates") if args.sweep_rates else [],
        sweep_fracs=number_list(args.sweep_fracs, "--sweep-fracs") if args.sweep_fracs else [],
        sweep_start_frac=args.sweep_start_frac, sweep_factor=args.sweep_factor, sweep_max_frac=args.sweep_max_frac,
        sweep_refine=args.sweep_refine, sweep_min_requests=args.sweep_min_requests,
        sweep_duration_s=args.sweep_duration, slo_p95_ms=args.slo_p95_ms,
        slo_x_idle=args.slo_x_idle, repeats=args.repeats, seed=args.seed,
        capacity_duration_s=args.capacity_duration, api_key=args.api_key, progress=not args.no_progress,
        threads=args.threads, timeout_s=args.timeout_s, timeout_slo=args.timeout_slo,
        latency_model=str(args.latency_model) if args.latency_model is not None else None, peers=peers,
        quality=quality, lora_dir=getattr(args, "lora_dir", None),
        controlnet_dir=getattr(args, "controlnet_dir", None), ip_adapter_dir=getattr(args, "ip_adapter_dir", None),
    )


def _peers(args: argparse.Namespace, argv: list[str], command: str) -> list:
    """--peers: the peer settings (bench/peers). Triton's classic layout runs the networks in onnxruntime, so a run
    with triton runs every contender's networks there (an explicit other --backend is refused)."""
    from ..bench.peers import parse_peers

    if command != "bench":
        raise UsageError(f"--peers starts live servers: it is for stepserve bench, not stepserve {command}")
    if args.target:
        raise UsageError("--peers and --target exclude each other: --peers starts its own servers")
    if args.model == "fake":
        raise UsageError("--peers serves a real model (embedded or a diffusers folder), not --model fake")
    try:
        peers = parse_peers(args.peers)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if any(p.peer == "triton" for p in peers) and args.backend != "onnxruntime":
        if any(a == "--backend" or a.startswith("--backend=") for a in argv):
            raise UsageError(f"--peers triton: Triton's classic layout runs the networks in onnxruntime; give "
                             f"--backend onnxruntime (or leave it out) so that every contender runs the same "
                             f"networks, not --backend {args.backend}")
        args.backend = "onnxruntime"
    return peers


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = config_from_args(argv)
        for target in cfg.targets:  # a wrong address: one line now, not a traceback after the model loads
            check_reachable(target)
    except (UsageError, ValueError) as exc:
        print(f"stepserve bench: {exc}", file=sys.stderr)
        return 2
    if cfg.progress:
        print(f"stepserve bench: {start_line(cfg)}", file=sys.stderr, flush=True)
    try:
        with sigterm_as_ctrl_c():  # peer servers and engines are stopped on either
            run = asyncio.run(run_bench(cfg))
    except (FileNotFoundError, ValueError) as exc:
        print(f"stepserve bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stepserve bench: interrupted; the engines and servers it started are stopped", file=sys.stderr)
        return INTERRUPTED
    return write_and_conclude(run, cfg.out)


def start_line(cfg: BenchConfig) -> str:
    """What the run is about to do, printed before anything slow (loading a model takes seconds)."""
    what = (f"{noun_for(len(cfg.targets), 'target')} {', '.join(cfg.targets)}" if cfg.targets else
            f"loading model {cfg.model}" + (f" for {len(cfg.peers)} peer setting(s)" if cfg.peers else ""))
    runs = plural(len(cfg.targets or cfg.contenders), "contender")  # each target is one; strategies are in-process
    runs += f" x {cfg.repeats} repeats" if cfg.repeats > 1 else ""
    timing = ("each run replays the trace" if cfg.load == "trace"
              else f"each run {cfg.warmup_s:g} s warm-up + {cfg.duration_s:g} s measured, then a drain")
    return f"{what}; {runs}; {timing}"


def write_and_conclude(run, out: Path) -> int:
    """Write the results files (bench and simulate), print the conclusions and where the report is; exit 0."""
    files = write_outputs(run, out)
    print("\n".join(plain(line) for line in run.results.conclusions))
    print(f"\nreport: {files[1]}  (all files in {out}/: {', '.join(f.name for f in files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
