"""`stepserve profile`: measure a model's stage latencies on this device and write them as a latency model file.

The file is what `stepserve serve --latency-model PATH` plans with (strategy slo) and what the simulator's
fake executor charges (stepserve.costs). The step and encode costs are measured with and
without guidance rows (stepserve.profiling.measure); the model's main curves are those of a request at the
model's default guidance. The metadata records the device, dtype, backend, threads, library versions, the machine,
the spread (fastest and slowest repeat) of every point, and the parallel degree it ran at (`parallel`,
stepserve.costs.degree: with --ulysses-degree 2 the steps are those of one request split over two ranks, and a
simulated replica charging the file holds two devices).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

from ..engine.loading import available_cores
from ..request.buckets import bucket_name
from ..util.words import plural
from .flags import (OneLineParser, add_fast_path_flags, add_model_flags, add_parallel_flags, degrees_from_args,
                    engine_config, int_from, model_of)

PROG = "stepserve profile"


def _guidance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (1 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number > 1 (the scale of the measurement with guidance rows; "
                                         f"the one without is always made too), got {text!r}")
    return value


def _sizes(text: str) -> list[tuple[int, ...]]:
    """'32x32,64x48' -> [(32, 32), (48, 64)]: WIDTHxHEIGHT as everywhere in stepserve (the HTTP API's "size"), as
    (height, width) shape buckets; a video model's WIDTHxHEIGHTxFRAMES ('64x32x17') -> (frames, height, width)."""
    out = []
    for part in text.split(","):
        sides = part.strip().lower().split("x")
        if len(sides) not in (2, 3) or not all(s.isdigit() and int(s) >= 1 for s in sides):
            raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT[xFRAMES][,...] in positive integers, "
                                             f"e.g. 32x32,64x48 (a video model: 64x32x17); got {text!r}")
        w, h, *frames = (int(s) for s in sides)
        out.append((*frames, h, w))
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"each size once, got {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Measure a model's step, encode and decode latencies on this device "
                                              "and write them as a latency model (JSON).")
    add_model_flags(p)
    p.add_argument("--max-batch-size", type=int_from(1), default=8,
                   help="largest batch measured (every size up to 16, then a geometric series; default %(default)s)")
    p.add_argument("--sizes", type=_sizes, default=None, metavar="WxH[,WxH...]",
                   help="shape buckets to measure, WxH (a video model: WxHxFRAMES; default: the model's default "
                        "size)")
    p.add_argument("--guidance-scale", type=_guidance, default=None,
                   help="scale of the measurement with guidance rows (default: the model's default if > 1, else 2)")
    p.add_argument("--repeats", type=int_from(1), default=5, help="recorded runs per point and round (default 5)")
    p.add_argument("--rounds", type=int_from(1), default=10,
                   help="sweeps over every point, taken in turn and pooled, so a slow spell of the machine spreads "
                        "over all points (default 10)")
    p.add_argument("--statistic", choices=("mean", "median"), default="mean",
                   help="what a point is of its recorded durations (default mean: a queue's load is the mean "
                        "service time times the rate, so this is what `simulate` and `plan` need)")
    p.add_argument("--warmup", type=int_from(0), default=1, help="unrecorded runs per point first (default 1)")
    p.add_argument("--out", required=True, metavar="PATH", help="the latency model file to write (JSON)")
    add_fast_path_flags(p)  # profile the engine as it will serve: compiled buckets, or the deterministic shapes
    add_parallel_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out).expanduser()
    if not out.parent.is_dir():
        print(f"{PROG}: error: --out {args.out!r}: folder {str(out.parent)!r} does not exist", file=sys.stderr)
        return 2
    from ..engine.config import EngineOptions, build_engine
    from ..engine.loading import check_model_argument
    from ..profiling.measure import measure_with_and_without_guidance

    try:
        check_model_argument(model_of(args))  # before the heavy imports
    except FileNotFoundError as exc:
        print(f"{PROG}: error: --{exc}", file=sys.stderr)
        return 2
    print(f"{PROG}: loading {args.model} on {args.device} ({args.dtype}, backend {args.backend}, "
          f"{plural(args.threads, 'thread')}{parallel_note(args)}) ...", file=sys.stderr, flush=True)
    try:  # the engine as it will serve (fast path included), without the memory cap: every batch size is measured
        config = engine_config(args, EngineOptions(max_batch_size=args.max_batch_size), memory_cap=False)
        loading = time.perf_counter()
        executor = build_engine(config).executor
        load_s = time.perf_counter() - loading  # a replica's start-up, as `simulate --autoscale` models it
    except (OSError, ValueError) as exc:
        print(f"{PROG}: error: cannot load model {args.model!r}: {exc}", file=sys.stderr)
        return 2
    try:
        latency = measure_with_and_without_guidance(executor, args.max_batch_size, args.sizes, args.guidance_scale,
                                                    repeats=args.repeats, warmup=args.warmup, progress=True,
                                                    rounds=args.rounds, statistic=args.statistic)
    except ValueError as exc:  # a size or guidance scale the model does not accept (ValidationError names it)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:  # a split engine's worker ranks stop now, not when the process exits
        close = getattr(executor, "close", None)
        if close is not None:
            close()
    latency.metadata.update(run_metadata(args))
    latency.metadata["load_s"] = round(load_s, 3)
    try:
        latency.save(out)
    except OSError as exc:
        print(f"{PROG}: error: cannot write {str(out)!r}: {exc}", file=sys.stderr)
        return 1
    ref = latency.reference_bucket
    n = args.max_batch_size
    print(f"{PROG}: wrote {out} ({latency.metadata.get('model')}, size {bucket_name(ref)}: step "
          f"{latency.step_s(1) * 1000:.2f} ms at batch 1, {latency.step_s(n) * 1000:.2f} ms at batch {n}; "
          f"measured in {latency.metadata.get('wall_s')} s{parallel_note(args)})", file=sys.stderr)
    return 0


def parallel_note(args: argparse.Namespace) -> str:
    """', --ulysses-degree 2 (2 devices)' when the engine splits each request; '' on one device."""
    d = degrees_from_args(args)
    return f", {d.describe()} ({d.world} devices)" if d.enabled else ""


def run_metadata(args: argparse.Namespace) -> dict[str, Any]:
    """What the measurement ran on, beyond what measure_latency_model records: the settings asked for, the
    machine and the versions of the libraries the backend uses."""
    versions: dict[str, str] = {}
    for name in ("torch", "diffusers", "transformers", "onnxruntime", "tensorrt", "numpy"):
        module = sys.modules.get(name)
        version = getattr(module, "__version__", None)
        if version is not None:
            versions[name] = str(version)
    from ..costs.degree import parallel_entry
    from ..version import __version__

    versions["stepserve"] = __version__
    versions["python"] = platform.python_version()
    d = degrees_from_args(args)
    return {
        "backend": args.backend,
        "fast_path": {"compile": args.compile, "deterministic": args.deterministic},
        "device_requested": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "parallel": parallel_entry(d.ulysses, d.ring, d.cfg, d.tensor),
        "versions": versions,
        "machine": {"platform": platform.platform(), "processor": cpu_name(), "cores": available_cores()},
    }


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what platform reports."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
