"""One trace, in process and through HTTP: stepserve servers (any strategy, any checkout) against the in-process
engine on the same open-loop trace.

1. `stepserve bench` in process on the embedded model: idle latency, capacity, a seeded Poisson trace at
   --rate-frac of capacity (or --rate), and the in-process contenders' numbers.
2. For every --server, a `stepserve serve` child process on loopback, driven by `stepserve bench --target` with
   that same trace and SLO; then it is stopped. With --repeats N the servers take turns, N rounds.
3. A table: p50 / p95 / goodput / refused per contender, and each one's ratio to the first server.

A server spec is `LABEL=STRATEGY[:DELAY_MS][@CHECKOUT]`: CHECKOUT runs the server from another source tree
(e.g. a `git worktree` of an older commit) with the same Python, so a change is measured before and after.

    python benchmarks/http_servers.py --out bench-out/http --inprocess continuous \\
        --server new=continuous --server old=continuous@/path/to/old/checkout --duration 30 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from common import ROOT, add_run_args, bench, free_port, stop_server, summaries, wait_until_healthy


@dataclass
class ServerSpec:
    label: str
    strategy: str
    delay_ms: float | None
    checkout: Path | None

    @classmethod
    def parse(cls, text: str) -> "ServerSpec":
        label, _, rest = text.partition("=")
        if not rest:
            raise SystemExit(f"--server {text!r}: expected LABEL=STRATEGY[:DELAY_MS][@CHECKOUT]")
        rest, _, checkout = rest.partition("@")
        strategy, _, delay = rest.partition(":")
        return cls(label, strategy, float(delay) if delay else None, Path(checkout) if checkout else None)


def start_server(spec: ServerSpec, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--model", args.model, "--strategy", spec.strategy,
           "--port", str(port), "--threads", str(args.threads), "--max-batch-size", str(args.max_batch_size),
           "--log-level", "warning"]
    if spec.delay_ms is not None:
        cmd += ["--max-queue-delay-ms", str(spec.delay_ms)]
    if args.timeout_s is not None:
        cmd += ["--timeout-s", str(args.timeout_s)]
    if args.max_queue is not None:
        cmd += ["--max-queue", str(args.max_queue)]
    cmd += args.server_arg
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    src = spec.checkout or ROOT
    env["PYTHONPATH"] = str(src)
    proc = subprocess.Popen(cmd, cwd=src, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, spec.label, timeout_s=120)
    return proc, url


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/http-servers")
    p.add_argument("--inprocess", default="continuous", help="in-process contenders (bench --strategies)")
    p.add_argument("--inprocess-delays-ms", default="50", help="bench --dynamic-delays-ms for in-process dynamic")
    p.add_argument("--server", action="append", default=[], type=ServerSpec.parse,
                   help="LABEL=STRATEGY[:DELAY_MS][@CHECKOUT], repeatable")
    p.add_argument("--server-arg", action="append", default=[], help="extra `stepserve serve` argument, repeatable")
    p.add_argument("--rate-frac", type=float, default=0.7)
    p.add_argument("--rate", type=float, help="absolute rate instead of --rate-frac")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-queue", type=int)
    p.add_argument("--timeout-s", type=float, help="server default deadline (--timeout-s of stepserve serve)")
    p.add_argument("--timeout-slo", action="store_true",
                   help="every request's deadline is the SLO: in process `bench --timeout-slo`, and every server "
                        "gets --timeout-s of the SLO the in-process run measured")
    p.add_argument("--slo-p95-ms", type=float, help="SLO (default: the in-process run's, 2x idle of the longest)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    inproc = args.out / "inprocess"
    load = ["--rate", str(args.rate)] if args.rate is not None else ["--rate-frac", str(args.rate_frac)]
    common = ["--steps", args.steps, "--duration", str(args.duration), "--warmup", str(args.warmup),
              "--seed", str(args.seed), "--max-batch-size", str(args.max_batch_size), "--no-progress"]
    slo = ["--slo-p95-ms", str(args.slo_p95_ms)] if args.slo_p95_ms else []
    bench(["--model", args.model, "--strategies", args.inprocess, "--dynamic-delays-ms", args.inprocess_delays_ms,
           "--threads", str(args.threads), "--repeats", str(args.repeats), "--out", str(inproc),
           *([] if args.max_queue is None else ["--max-queue", str(args.max_queue)]),
           *(["--timeout-slo"] if args.timeout_slo else []), *load, *common, *slo])
    results = json.loads((inproc / "results.json").read_text())
    slo_ms = args.slo_p95_ms or results["slo_s"] * 1000.0
    if args.timeout_slo:
        args.timeout_s = slo_ms / 1000.0
    rate = results["settings"]["rate_rps"]
    trace = inproc / "trace.jsonl"
    print(f"trace: {trace} at {rate:.2f} req/s; SLO p95 {slo_ms:.0f} ms", flush=True)

    rows: dict[str, list[dict]] = {}
    for label, s in summaries(inproc).items():
        rows[f"in-process {label}"] = [s]
    for repeat in range(args.repeats):
        order = args.server[repeat % len(args.server):] + args.server[:repeat % len(args.server)]
        for spec in order:
            proc, url = start_server(spec, args)
            try:
                out = args.out / f"{spec.label}-r{repeat + 1}"
                bench(["--target", f"{spec.label}={url}", "--load", "trace", "--trace", str(trace),
                       "--slo-p95-ms", str(slo_ms), "--out", str(out), *common])
                rows.setdefault(spec.label, []).extend(summaries(out).values())
            finally:
                stop_server(proc)
    capacity = (results.get("capacity") or {}).get("rps")
    print_table(rows, [s.label for s in args.server], capacity)


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def print_table(rows: dict[str, list[dict]], servers: list[str], capacity_rps: float | None) -> None:
    """Medians over repeats; counts summed. goodput/cap uses the in-process run's measured capacity."""

    def med(label: str, key: str) -> float | None:
        return _median([(s.get(key) or {}).get("median") for s in rows[label]])

    def worst(label: str, key: str) -> float | None:
        values = [(s.get(key) or {}).get("high") for s in rows[label]]
        values = [v for v in values if v is not None]
        return max(values) if values else None

    base = servers[0] if servers else None
    print(f"\n{'contender':28} {'p50 ms':>8} {'p95 ms':>8} {'goodput/s':>10} {'/cap':>5} {'done':>6} {'refused':>8} "
          f"{'missed':>7} {'lateOK':>7} {'refuse p99':>10} {'max ms':>7} {'p50 x':>6} {'p95 x':>6}")
    summary = {}
    for label in rows:
        p50, p95, good = med(label, "p50_s"), med(label, "p95_s"), med(label, "goodput_rps")
        done = sum(s["completed"] for s in rows[label])
        refused = sum(s["rejected"] for s in rows[label])
        missed = sum(s.get("deadline_missed", 0) for s in rows[label])
        late = sum(s.get("late_ok", 0) for s in rows[label])
        r99, rmax = med(label, "refusal_p99_ms"), worst(label, "refusal_max_ms")
        frac = good / capacity_rps if good is not None and capacity_rps else None
        r50 = r95 = ""
        if base and p50 and p95 and med(base, "p50_s"):
            r50, r95 = f"{p50 / med(base, 'p50_s'):.2f}", f"{p95 / med(base, 'p95_s'):.2f}"
        print(f"{label:28} {fmt(p50)} {fmt(p95)} {good or 0:10.2f} {frac or 0:5.2f} {done:6d} {refused:8d} "
              f"{missed:7d} {late:7d} {opt(r99):>10} {opt(rmax):>7} {r50:>6} {r95:>6}")
        summary[label] = {"p50_ms": p50 and p50 * 1000, "p95_ms": p95 and p95 * 1000, "goodput_rps": good,
                          "goodput_frac": frac, "completed": done, "refused": refused, "deadline_missed": missed,
                          "late_ok": late, "refusal_p99_ms": r99, "refusal_max_ms": rmax}
    print(json.dumps(summary))


def opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def fmt(seconds: float | None) -> str:
    return f"{seconds * 1000:8.0f}" if seconds is not None else f"{'-':>8}"


if __name__ == "__main__":
    main()
