"""The flags of `stepserve bench` (and of `stepserve simulate`, which parses the same ones under its own name so
command lines carry over), with the error a bad one raises."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..scheduling import DEFAULT_STRATEGY, STRATEGIES
from .flags import DefaultsHelpFormatter, add_fast_path_flags, add_parallel_flags, add_model_flags

LOADS = ("poisson", "closed", "trace")


class UsageError(Exception):
    """A bad flag; the message names what is allowed."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the whole usage block
        raise UsageError(message)


def number_list(text: str, name: str, positive: bool = True) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{name}: {text!r} is not a comma-separated list of numbers, e.g. 10,50,200") from None
    if not values or (positive and any(v <= 0 for v in values)):
        raise UsageError(f"{name}: expected positive numbers separated by commas, got {text!r}")
    return values


def build_parser(prog: str = "stepserve bench", description: str | None = __doc__) -> argparse.ArgumentParser:
    """The bench flags; `stepserve simulate` parses the same ones (under its own name) so command lines carry over."""
    p = _Parser(prog=prog, description=description, formatter_class=DefaultsHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--target", action="append", default=[],
                      help="URL of a running stepserve server (repeatable; 'label=URL' names it), or a Triton "
                           "model over KServe v2: 'triton=grpc://HOST:PORT[/MODEL]' or 'triton=http://HOST:PORT"
                           "[/MODEL]' (MODEL default pipeline; 'triton:label=URL' names it; a decoupled model "
                           "needs the gRPC port); default: in-process")
    p.add_argument("--peers", help="also serve the model with peer servers on loopback, each batching its own way: "
                                   "comma-separated triton, ray, litserve, each optionally @BATCHxWAIT_MS (e.g. "
                                   "ray@8x50; bare: max batch 4/8 x wait 10/50 ms); the --strategies (default "
                                   f"{DEFAULT_STRATEGY}) then run as stepserve serve. With triton the networks run in "
                                   "onnxruntime everywhere (--backend onnxruntime is implied)")
    add_model_flags(p, "embedded | PATH to a diffusers folder | fake (no model)", " (in-process only)",
                    model_in=what)
    if prog != "stepserve simulate":  # a simulated clock has no kernels to compile
        add_fast_path_flags(p)  # in-process only
        add_parallel_flags(p)
    p.add_argument("--strategies",
                   help=f"comma-separated: {', '.join(STRATEGIES)}; default: every one")
    p.add_argument("--dynamic-delays-ms", default="10,50,200", help="one dynamic contender per max_queue_delay")
    p.add_argument("--max-batch-size", type=int, default=8, help="most requests in one denoising step")
    p.add_argument("--static-batch-size", type=int, help="static's batch size (default: --max-batch-size)")
    p.add_argument("--max-queue", type=int, help="engine queue bound; over it requests are rejected (default: none)")
    mix = p.add_mutually_exclusive_group()
    mix.add_argument("--mix", type=Path, help="request mix file (YAML or JSON)")
    mix.add_argument("--steps", default="8,20,40", help="step counts drawn uniformly (when no --mix)")
    p.add_argument("--load", default="poisson", choices=LOADS, help="open-loop poisson (default), closed loop, trace")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=float, help="poisson arrivals per second")
    rate.add_argument("--rate-frac", type=float, help="poisson rate as a fraction of measured capacity (default 0.7)")
    p.add_argument("--users", type=int, default=8, help="closed-loop users")
    p.add_argument("--trace", type=Path, help="trace file (CSV or JSONL) for --load trace")
    p.add_argument("--duration", type=float, default=30.0,
                   help="measured seconds per run; each run lasts --warmup + --duration, then drains")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds of load before the measured --duration, not counted")
    p.add_argument("--drain", type=float, help="seconds to wait for answers after the last send (default 3x SLO)")
    p.add_argument("--capacity-duration", type=float, default=10.0, help="seconds of the capacity measurement")
    p.add_argument("--sweep", action="store_true", help="also sweep the rate to find each contender's knee")
    p.add_argument("--sweep-rates", help="sweep a fixed grid of rates in req/s, e.g. 1,2,4 (default: search)")
    p.add_argument("--sweep-fracs", help="sweep a fixed grid of fractions of measured capacity, e.g. 0.2,0.4,0.8")
    p.add_argument("--sweep-start-frac", type=float, default=0.15, help="search: first rate / capacity")
    p.add_argument("--sweep-factor", type=float, default=1.5, help="search: climb by this factor until a miss")
    p.add_argument("--sweep-max-frac", type=float, default=1.5, help="search: highest rate / capacity")
    p.add_argument("--sweep-refine", type=int, default=3, help="search: bisection steps after the first miss")
    p.add_argument("--sweep-duration", type=float, help="measured seconds per sweep point (default --duration)")
    p.add_argument("--sweep-min-requests", type=int, default=50,
                   help="lengthen a sweep point until it has this many measured requests")
    slo = p.add_mutually_exclusive_group()
    slo.add_argument("--slo-p95-ms", type=float, help="latency SLO in ms")
    slo.add_argument("--slo-x-idle", type=float, default=2.0, help="SLO = K x idle latency of the longest request")
    deadline = p.add_mutually_exclusive_group()
    deadline.add_argument("--timeout-s", type=float, metavar="S",
                          help="every request carries this deadline in seconds (timeout_s; HTTP: the body's "
                               "\"timeout_s\"); the engine fails a request it cannot finish by then")
    deadline.add_argument("--timeout-slo", action="store_true",
                          help="every request's deadline (timeout_s) is the run's SLO (--slo-p95-ms, or "
                               "--slo-x-idle K x the idle latency of the longest request, measured first)")
    p.add_argument("--latency-model", type=Path, metavar="PATH",
                   help="slo contenders (in-process): load their latency model from this file (written by "
                        "LatencyModel.save, or a previous run's latency_model.json) instead of measuring it")
    p.add_argument("--repeats", type=int, default=1, help="replays of the whole comparison (spread reported)")
    if prog != "stepserve simulate":
        p.add_argument("--lora-dir", metavar="DIR",
                       help="in process: load every *.safetensors in DIR as a LoRA adapter (named by its file name); "
                            "a mix's 'lora' field draws one per request")
        p.add_argument("--controlnet-dir", metavar="DIR",
                       help="in process: serve the ControlNets of DIR (one folder per name); a mix's 'control' "
                            "field draws one per request (docs/CONTROLNET.md)")
        p.add_argument("--ip-adapter-dir", metavar="DIR",
                       help="in process: serve the IP-Adapters of DIR (one folder per name); a mix's 'ip_adapter' "
                            "field draws one per request (docs/CONTROLNET.md)")
        p.add_argument("--quality", action="store_true",
                       help="in process: PSNR / SSIM of every image that used step caching (a mix's 'cache' "
                            "field) against the same request generated without it, beside latency in the report")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals, the request mix and the images")
    p.add_argument("--api-key", help="bearer key for --target servers that need one")
    p.add_argument("--out", type=Path, default=Path("sim-out" if prog == "stepserve simulate" else "bench-out"),
                   help="folder for report.md, results.json, the plots and the raw logs")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p
