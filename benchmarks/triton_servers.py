"""stepserve's continuous batching against Triton, on one open-loop trace: stepserve over HTTP, the `stepserve`
Triton repository (the same engine inside a decoupled Python-backend model), and the `classic` Triton repository
(Triton's dynamic batcher in front of a BLS pipeline over ONNX networks: request-level batching).

Every contender runs the networks in onnxruntime with the same threads, so the batching is what differs.

1. `stepserve bench` in process (onnxruntime backend, continuous): idle latency, capacity, the SLO (2x the idle
   latency of the longest request unless --slo-p95-ms) and a seeded Poisson trace at --rate-frac of capacity.
2. Each contender in turn: its server is started, driven by `stepserve bench --target` with that trace (p50, p95,
   goodput within the SLO), then, with --sweep-fracs, by a rate sweep over those fractions of capacity (the knee:
   the highest rate whose p95 held the SLO), then stopped.
   Before that, one user sends the longest request of the mix alone for a few seconds: each layout's idle latency.
3. A table of medians over --repeats, each contender's ratios to the best classic repository, and a JSON summary.

    python benchmarks/triton_servers.py --out bench-out/triton --rate-frac 0.7 --duration 30 \\
        --sweep-fracs 0.4,0.6,0.8,1.0,1.2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import ROOT, add_run_args, bench, stop_server, summaries
from http_servers import ServerSpec, print_table, start_server

CONTENDERS = ("stepserve-http", "triton-stepserve", "triton-classic")


def classic_label(delay_ms: float) -> str:
    return f"triton-classic-{delay_ms:g}ms"


def export_repo(label: str, args) -> Path:
    """The repository behind a Triton contender: `triton-stepserve`, or `triton-classic-<delay>ms`."""
    repo = args.out / f"repo-{label}"
    mode = "classic" if label.startswith("triton-classic") else "stepserve"
    cmd = [sys.executable, "-m", "stepserve.cli", "export", "triton", "--model", args.model, "--out", str(repo),
           "--mode", mode, "--max-batch-size", str(args.max_batch_size), "--threads", str(args.threads)]
    if mode == "classic":
        cmd += ["--max-queue-delay-ms", label.removeprefix("triton-classic-").removesuffix("ms")]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return repo


class Contender:
    """Starts one server and gives the bench --target for it."""

    def __init__(self, label: str, args, repos: dict[str, Path]) -> None:
        self.label, self.args, self.repos = label, args, repos
        self.proc = self.triton = None

    def __enter__(self) -> str:
        if self.label == "stepserve-http":
            spec = ServerSpec(self.label, "continuous", None, None)
            self.proc, url = start_server(spec, self.args)
            return f"{self.label}={url}"
        from stepserve.deploy.triton.server import TritonServer

        self.triton = TritonServer(self.repos[self.label], quiet=True).start()
        return f"triton:{self.label}=grpc://{self.triton.grpc_url}"

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            stop_server(self.proc)
        if self.triton is not None:
            self.triton.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/triton")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated: {', '.join(CONTENDERS)}")
    p.add_argument("--rate-frac", type=float, default=0.7)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--classic-delays-ms", default="10,50",
                   help="one classic repository per dynamic-batcher delay; the best is the base of the ratios")
    p.add_argument("--slo-p95-ms", type=float, help="SLO (default: the in-process run's, 2x idle of the longest)")
    p.add_argument("--timeout-slo", action="store_true", help="every request carries the SLO as its deadline")
    p.add_argument("--sweep-fracs", help="also sweep these fractions of capacity for each contender's knee")
    p.add_argument("--sweep-duration", type=float, default=15.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [c for c in args.contenders.split(",") if c]
    if unknown := set(chosen) - set(CONTENDERS):
        raise SystemExit(f"--contenders: unknown {sorted(unknown)}; allowed: {', '.join(CONTENDERS)}")
    labels = [label for c in chosen for label in (
        [classic_label(float(d)) for d in args.classic_delays_ms.split(",")] if c == "triton-classic" else [c])]
    # start_server (http_servers) reads these
    args.timeout_s, args.max_queue = None, None
    args.server_arg = ["--backend", "onnxruntime"]

    inproc = args.out / "inprocess"
    common = ["--steps", args.steps, "--duration", str(args.duration), "--warmup", str(args.warmup),
              "--seed", str(args.seed), "--no-progress"]
    slo = ["--slo-p95-ms", str(args.slo_p95_ms)] if args.slo_p95_ms else []
    bench(["--model", args.model, "--backend", "onnxruntime", "--strategies", "continuous", "--threads",
           str(args.threads), "--max-batch-size", str(args.max_batch_size), "--rate-frac", str(args.rate_frac),
           "--out", str(inproc), *(["--timeout-slo"] if args.timeout_slo else []), *common, *slo])
    results = json.loads((inproc / "results.json").read_text())
    slo_ms = args.slo_p95_ms or results["slo_s"] * 1000.0
    capacity = (results.get("capacity") or {}).get("rps")
    trace = inproc / "trace.jsonl"
    deadline = ["--timeout-s", str(slo_ms / 1000.0)] if args.timeout_slo else []
    print(f"trace: {trace} at {results['settings']['rate_rps']:.2f} req/s; SLO p95 {slo_ms:.0f} ms; "
          f"capacity {capacity:.2f} req/s", flush=True)

    repos = {label: export_repo(label, args) for label in labels if label.startswith("triton-")}
    rows: dict[str, list[dict]] = {}
    knees: dict[str, list[dict]] = {}
    idle: dict[str, list[float]] = {}  # p50 of the longest request alone (one user, closed loop)
    args.longest = str(max(int(x) for x in args.steps.split(",")))
    for repeat in range(args.repeats):
        order = labels[repeat % len(labels):] + labels[:repeat % len(labels)]
        for label in order:
            with Contender(label, args, repos) as target:
                idle_out = args.out / f"{label}-idle-r{repeat + 1}"
                bench(["--target", target, "--load", "closed", "--users", "1", "--steps", args.longest,
                       "--duration", "6", "--warmup", "1", "--seed", str(args.seed), "--slo-p95-ms", str(slo_ms),
                       "--out", str(idle_out), "--no-progress"])
                idle.setdefault(label, []).extend(s["p50_s"]["median"] for s in summaries(idle_out).values())
                out = args.out / f"{label}-r{repeat + 1}"
                bench(["--target", target, "--load", "trace", "--trace", str(trace), "--slo-p95-ms", str(slo_ms),
                       "--out", str(out), *deadline, *common])
                rows.setdefault(label, []).extend(summaries(out).values())
                if args.sweep_fracs and capacity:
                    rates = ",".join(f"{float(f) * capacity:.3f}" for f in args.sweep_fracs.split(","))
                    sweep_out = args.out / f"{label}-sweep-r{repeat + 1}"
                    bench(["--target", target, "--sweep", "--sweep-rates", rates, "--sweep-duration",
                           str(args.sweep_duration), "--duration", str(args.sweep_duration), "--steps", args.steps,
                           "--seed", str(args.seed), "--slo-p95-ms", str(slo_ms), "--out", str(sweep_out),
                           "--no-progress", *deadline])
                    knees.setdefault(label, []).extend(json.loads((sweep_out / "results.json").read_text())["knees"])
    def goodput(label: str) -> float:
        values = sorted(s["goodput_rps"]["median"] for s in rows[label])
        return values[len(values) // 2]

    classics = [k for k in rows if k.startswith("triton-classic")]
    best = max(classics, key=goodput) if classics else None  # the base of the ratios: the best classic delay
    ordered = sorted(rows, key=lambda k: k != best)
    print_table({k: rows[k] for k in ordered}, ordered, capacity)
    if best:
        for label in ordered:
            ratio = f"{goodput(label) / goodput(best):5.2f}x" if goodput(best) > 0 else "(the best classic: 0/s)"
            print(f"goodput {label:22} {goodput(label):6.2f}/s  = {ratio} the best classic layout ({best})")
    for label, values in idle.items():
        print(f"idle {label:18} {args.longest}-step request alone: p50 "
              + ", ".join(f"{v * 1000:.0f} ms" for v in values) + f" (SLO {slo_ms:.0f} ms)")
    for label, ks in knees.items():
        rates = [k["rate_rps"] for k in ks]
        print(f"knee {label:18} " + ", ".join("-" if r is None else f"{r:.2f} req/s" for r in rates)
              + (f" ({rates[0] / capacity:.2f}x capacity)" if rates and rates[0] and capacity else ""))
    print(json.dumps({"slo_ms": slo_ms, "capacity_rps": capacity, "knees": knees, "idle_p50_s": idle}))


if __name__ == "__main__":
    main()
