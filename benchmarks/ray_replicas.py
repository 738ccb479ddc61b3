"""One replica against two, through Ray Serve, on one open-loop trace (and the single-process server beside them);
or two replicas behind the fleet's router (least_work) against two behind Ray Serve's own (power of two choices),
with a second power-of-two pair as an A/A control that shows the noise.

1. `stepserve bench` in process on the model (one thread) measures one engine's capacity and writes a seeded
   Poisson trace at --rate-frac of it.
2. Each contender is a `stepserve serve` child process on loopback: `single` (no Ray), `ray-1` (--replicas 1) and
   `ray-2` (--replicas 2), each replica on one thread and one reserved CPU (OMP_NUM_THREADS=1 for all), Ray on a
   local cluster it starts and stops. `stepserve bench --target` replays the same trace against it. With
   --repeats N the contenders take turns, N rounds, starting from a different one each round.
3. A table: completed requests per second, p50, p95 (all requests; unfinished ones count as infinitely late),
   medians over the rounds, each contender's ratios to ray-1 in the same round, and every round's p50/p95.

    python benchmarks/ray_replicas.py --out bench-out/ray-replicas --rate-frac 0.7 --duration 30 --repeats 3
    python benchmarks/ray_replicas.py --out bench-out/ray-replicas --summarize     # the table again
    python benchmarks/ray_replicas.py --out bench-out/ray-routers --contenders lw-2,p2-2,p2-2b --baseline p2-2 \
        --steps 4,20,50 --rate-frac 1.6 --duration 60 --repeats 3    # 80% of the pair's capacity
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import ROOT, add_run_args, bench, free_port, stop_server, wait_until_healthy

CONTENDERS = {"single": [], "ray-1": ["--replicas", "1", "--replica-cpus", "1"],
              "ray-2": ["--replicas", "2", "--replica-cpus", "1"],
              # the routers (docs/SCALING.md): the fleet's least_work, Ray's power of two choices, and that again
              "lw-2": ["--replicas", "2", "--replica-cpus", "1", "--router", "least_work"],
              "p2-2": ["--replicas", "2", "--replica-cpus", "1", "--router", "power_of_two"],
              "p2-2b": ["--replicas", "2", "--replica-cpus", "1", "--router", "power_of_two"]}


def start(label: str, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--model", args.model, "--port", str(port), "--threads",
           "1", "--max-batch-size", str(args.max_batch_size), "--log-level", "warning", *CONTENDERS[label]]
    log = open(args.out / f"{label}-server.log", "a")
    # OMP_NUM_THREADS=1 for every contender: Ray gives it to a replica that reserves one CPU, so the single-process
    # server gets it too.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, label, timeout_s=180, poll_s=0.5, log=log.name)
    return proc, url


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/ray-replicas", threads=False)  # every replica runs on one thread
    p.add_argument("--contenders", default="single,ray-1,ray-2")
    p.add_argument("--rate-frac", type=float, default=1.5, help="of one engine's in-process capacity (1 thread)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--baseline", default=None, help="the contender the ratios are to (default: ray-1, else the first)")
    p.add_argument("--summarize", action="store_true", help="only print the table of the runs already in --out")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    labels = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in labels if c not in CONTENDERS]
    if unknown:
        raise SystemExit(f"--contenders: unknown {unknown}; allowed: {', '.join(CONTENDERS)}")
    if args.summarize:
        rows = {label: [json.loads(f.read_text())["runs"][0]
                        for f in sorted(args.out.glob(f"{label}-r*/results.json"))] for label in labels}
        table(rows, args.duration, args.baseline)
        return

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
                stop_server(proc, grace_s=120)  # Ray's replicas take a while to shut down
    table(rows, args.duration, args.baseline)


def table(rows: dict[str, list[dict]], duration_s: float, baseline: str | None = None) -> None:
    """Per round and the median over rounds (the mean of the middle two for an even count); ratios to ray-1 are
    taken round by round (the contenders of one round ran back to back) before their median."""

    def done(run: dict) -> float:
        return run["counts"]["completed"] / duration_s

    def p50(run: dict) -> float | None:
        return (run["latency"] or {}).get("p50")

    def p95(run: dict) -> float:
        value = run["p95_all_s"]  # None or inf when more than 5% never finished
        return float("inf") if value is None else value

    base = baseline or ("ray-1" if "ray-1" in rows else next(iter(rows)))
    print(f"\n{'contender':10} {'done/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'done x':>7} {'p95 x':>6}  per round "
          f"(p50/p95 ms)")
    summary = {}
    for label, runs in rows.items():
        pairs = list(zip(runs, rows[base]))
        done_x = median([done(r) / done(b) for r, b in pairs if done(b)])
        p95_x = median([p95(r) / p95(b) for r, b in pairs if p95(b) not in (0, float("inf"))])
        rounds = " ".join(f"{ms(p50(r)).strip()}/{ms(p95(r)).strip()}" for r in runs)
        row = {"completed_rps": median([done(r) for r in runs]), "p50_s": median([p50(r) for r in runs]),
               "p95_all_s": median([p95(r) for r in runs]), "done_x": done_x, "p95_x": p95_x}
        print(f"{label:10} {row['completed_rps'] or 0:7.2f} {ms(row['p50_s'])} {ms(row['p95_all_s'])} "
              f"{opt(done_x, 7)} {opt(p95_x, 6)}  {rounds}")
        summary[label] = row
    print(json.dumps(summary))


def opt(value: float | None, width: int) -> str:
    return f"{value:{width}.2f}" if value is not None and value != float("inf") else f"{'-':>{width}}"


def ms(seconds: float | None) -> str:
    return f"{seconds * 1000:8.0f}" if seconds is not None and seconds != float("inf") else f"{'-':>8}"


if __name__ == "__main__":
    main()
