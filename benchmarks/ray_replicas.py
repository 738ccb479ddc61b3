"""One replica against two, through Ray Serve, on one open-loop trace (and the single-process server beside them).

1. `stepserve bench` in process on the model (one thread) measures one engine's capacity and writes a seeded
   Poisson trace at --rate-frac of it.
2. Each contender is a `stepserve serve` child process on loopback: `single` (no Ray), `ray-1` (--replicas 1) and
   `ray-2` (--replicas 2), each replica on one thread and one reserved CPU, Ray on a local cluster it starts and
   stops. `stepserve bench --target` replays the same trace against it. With --repeats N the contenders take
   turns, N rounds, starting from a different one each round.
3. A table of medians over the rounds: completed requests per second, p50, p95 (all requests, refused ones as
   infinitely late) and each contender's ratio to ray-1.

    python benchmarks/ray_replicas.py --out bench-out/ray-replicas --rate-frac 1.5 --duration 30 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = {"single": [], "ray-1": ["--replicas", "1", "--replica-cpus", "1"],
              "ray-2": ["--replicas", "2", "--replica-cpus", "1"]}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(label: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--model", args.model, "--port", str(port), "--threads",
           "1", "--max-batch-size", str(args.max_batch_size), "--log-level", "warning", *CONTENDERS[label]]
    log = open(args.out / f"{label}-server.log", "a")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{label} exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"{label} did not become ready within 180 s; see {log.name}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(argv: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "stepserve.cli", "bench", *argv], check=True, cwd=ROOT)


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench-out/ray-replicas"))
    p.add_argument("--model", default="embedded")
    p.add_argument("--contenders", default="single,ray-1,ray-2")
    p.add_argument("--steps", default="8,20,40")
    p.add_argument("--rate-frac", type=float, default=1.5, help="of one engine's in-process capacity (1 thread)")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch-size", type=int, default=8)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    labels = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in labels if c not in CONTENDERS]
    if unknown:
        raise SystemExit(f"--contenders: unknown {unknown}; allowed: {', '.join(CONTENDERS)}")

    common = ["--steps", args.steps, "--duration", str(args.duration), "--warmup", str(args.warmup), "--seed",
              str(args.seed), "--max-batch-size", str(args.max_batch_size), "--no-progress"]
    inproc = args.out / "inprocess"
    bench(["--model", args.model, "--strategies", "continuous", "--threads", "1", "--rate-frac",
           str(args.rate_frac), "--out", str(inproc), *common])
    results = json.loads((inproc / "results.json").read_text())
    rate, slo_ms = results["settings"]["rate_rps"], results["slo_s"] * 1000.0
    capacity = (results.get("capacity") or {}).get("rps")
    trace = inproc / "trace.jsonl"
    print(f"trace: {trace} at {rate:.2f} req/s (one engine's capacity {capacity} req/s); SLO p95 {slo_ms:.0f} ms",
          flush=True)

    rows: dict[str, list[dict]] = {label: [] for label in labels}
    for repeat in range(args.repeats):
        for label in labels[repeat % len(labels):] + labels[:repeat % len(labels)]:
            proc, url = start(label, args)
            try:
                out = args.out / f"{label}-r{repeat + 1}"
                bench(["--target", f"{label}={url}", "--load", "trace", "--trace", str(trace), "--slo-p95-ms",
                       str(slo_ms), "--out", str(out), *common])
                run = json.loads((out / "results.json").read_text())["runs"][0]
                rows[label].append(run)
            finally:
                stop(proc)
    table(rows, args.duration)


def table(rows: dict[str, list[dict]], duration_s: float) -> None:
    def med(label: str, pick) -> float | None:
        return median([pick(run) for run in rows[label]])

    done = {label: med(label, lambda r: r["counts"]["completed"] / duration_s) for label in rows}
    p50 = {label: med(label, lambda r: (r["latency"] or {}).get("p50")) for label in rows}
    p95 = {label: med(label, lambda r: r["p95_all_s"]) for label in rows}
    base = "ray-1" if "ray-1" in rows else next(iter(rows))
    print(f"\n{'contender':10} {'done/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'done x':>7} {'p95 x':>6} {'rounds':>6}")
    for label in rows:
        ratio = (f"{done[label] / done[base]:7.2f}" if done[label] and done[base] else f"{'-':>7}")
        p95_ratio = (f"{p95[label] / p95[base]:6.2f}" if p95[label] and p95[base] and p95[base] != float("inf")
                     else f"{'-':>6}")
        print(f"{label:10} {done[label] or 0:7.2f} {ms(p50[label])} {ms(p95[label])} {ratio} {p95_ratio} "
              f"{len(rows[label]):6d}")
    print(json.dumps({label: {"completed_rps": done[label], "p50_ms": p50[label] and p50[label] * 1000,
                              "p95_all_ms": p95[label] and p95[label] * 1000} for label in rows}))


def ms(seconds: float | None) -> str:
    return f"{seconds * 1000:8.0f}" if seconds is not None and seconds != float("inf") else f"{'-':>8}"


if __name__ == "__main__":
    main()
