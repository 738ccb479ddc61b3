"""One request split over two ranks on this CPU, against one rank and against two replicas (docs/SCALING.md).

The tiny Flux.1 at its benchmark size (stepserve/tiny/flux.py BENCH_OPTIONS), built in a temp folder:

1. One large request (--size, --steps), in process, rounds alternated, medians: degree 1 on 1 thread, degree 1 on
   2 threads (both cores to one process), and --ulysses-degree 2 (two ranks, one thread each, over gloo).
2. What gloo costs per step at degree 2: the collectives' time inside one denoising step on rank 0 (torch's
   profiler: all-to-all, all-gather and their waits), against the whole step.
3. The mixed load of the regime matrix's live tiny-Flux row (steps 4/10/20, two sizes, guidance on and off) as one
   seeded Poisson trace at --load x the measured capacity, sent over HTTP to (a) one server at --ulysses-degree 2
   (1 thread per rank) and (b) two servers at degree 1 (1 thread each), the client sending each request to the
   replica with fewer in flight; p50 / p95 / throughput of each.

    python benchmarks/parallel_cpu.py [--size 128] [--steps 8] [--rounds 5] [--duration 60] [--load 0.6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import free_port, stop_server, wait_until_healthy


def build(root: Path) -> Path:
    from stepserve.tiny.flux import BENCH_OPTIONS, build_tiny_flux

    return build_tiny_flux(root / "flux", **BENCH_OPTIONS)


def one_request(model: Path, size: int, steps: int, rounds: int) -> dict:
    import torch

    from stepserve import Engine, SamplingParams
    from stepserve.parallel.degrees import Degrees

    params = SamplingParams(prompt="a lighthouse at dusk", width=size, height=size, num_inference_steps=steps,
                            seed=7, guidance_scale=3.5)
    one = Engine.from_pretrained(str(model), threads=None, memory_cap=False, strategy="continuous")
    torch.set_num_threads(1)
    two = Engine.from_pretrained(str(model), threads=None, memory_cap=False, strategy="continuous",
                                 degrees=Degrees(ulysses=2))
    cases = {"degree 1, 1 thread": (one, 1), "degree 1, 2 threads": (one, 2), "ulysses 2, 1 thread/rank": (two, 1)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    try:
        names = list(cases)
        for r in range(rounds + 1):
            for name in names[r % len(names):] + names[: r % len(names)]:
                engine, threads = cases[name]
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                out = engine.generate([params])[0]
                if not out.ok:
                    raise SystemExit(f"{name}: {out.error}")
                if r:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
        gloo = gloo_share(two, params)
    finally:
        two.executor.close()
    return {"medians_s": {k: statistics.median(v) for k, v in times.items()}, "gloo": gloo}


def gloo_share(engine, params) -> dict:
    """The collectives' seconds inside denoising steps on rank 0, against the steps' seconds (one request)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.generate([params])
        wall = time.perf_counter() - t0
    words = ("all_to_all", "all_gather", "wait_tensor", "allgather", "alltoall")
    comm = sum(e.self_cpu_time_total for e in prof.key_averages() if any(w in e.key.lower() for w in words)) / 1e6
    return {"collectives_s": comm, "wall_s": wall, "steps": params.num_inference_steps,
            "per_step_ms": comm / params.num_inference_steps * 1e3}


def serve(model: Path, extra: list[str]):
    import os
    import subprocess

    port = free_port()
    cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--model", str(model), "--port", str(port),
           "--threads", "1", "--log-level", "warning", "--max-batch-size", "8", *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, " ".join(extra) or "degree 1", timeout_s=300)
    return proc, url


async def replay(urls: list[str], trace) -> dict:
    from stepserve.bench.targets import HttpTarget

    targets = [HttpTarget(u) for u in urls]
    for t in targets:
        await t.start()
    inflight = [0] * len(targets)
    latencies: list[float] = []
    failed = 0
    start = time.perf_counter()

    async def one(item) -> None:
        nonlocal failed
        await asyncio.sleep(max(0.0, start + item.offset_s - time.perf_counter()))
        i = min(range(len(targets)), key=lambda k: inflight[k])  # fewer in flight (ties: the first)
        inflight[i] += 1
        t0 = time.perf_counter()
        reply = await targets[i].send(item.spec)
        inflight[i] -= 1
        if reply.status == "ok":
            latencies.append(time.perf_counter() - t0)
        else:
            failed += 1

    await asyncio.gather(*(one(item) for item in trace.items))
    wall = time.perf_counter() - start
    for t in targets:
        await t.stop()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [float("nan")] * 99
    return {"done": len(latencies), "failed": failed, "p50_s": statistics.median(latencies), "p95_s": q[94],
            "throughput_rps": len(latencies) / wall}


def mixed_load(model: Path, per_image_s: float, duration: float, load: float, seed: int) -> dict:
    from stepserve.bench.workload import Choice, Mix, poisson_trace

    mix = Mix(steps=Choice([4, 10, 20], [1.0, 1.0, 1.0]), guidance_scale=Choice([1.0, 3.5], [1.0, 1.0]),
              size=Choice(["64x64", "128x128"], [1.0, 1.0]))
    # capacity: two cores' worth of the one-request cost at the mix's mean steps, as images per second
    rate = load * 2.0 / (per_image_s * (34 / 3) / 8)
    trace = poisson_trace(mix, rate, duration, seed)
    out = {"rate_rps": rate, "requests": len(trace.items)}
    for label, servers in (("ulysses 2 (one server)", [["--ulysses-degree", "2"]]),
                           ("2 replicas of degree 1", [[], []])):
        procs = [serve(model, extra) for extra in servers]
        try:
            out[label] = asyncio.run(replay([url for _, url in procs], trace))
        finally:
            for proc, _ in procs:
                stop_server(proc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of mixed-load trace (0: skip part 3)")
    ap.add_argument("--load", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="parallel-cpu-"))
    model = build(root)
    one = one_request(model, args.size, args.steps, args.rounds)
    m = one["medians_s"]
    base = m["degree 1, 1 thread"]
    print(f"\n== one {args.size}x{args.size} request, {args.steps} steps (tiny Flux.1 at benchmark size) ==")
    for name, s in m.items():
        print(f"{name:<28}{s * 1e3:>10.0f} ms  {base / s:>6.2f}x of degree 1 on 1 thread")
    g = one["gloo"]
    print(f"gloo collectives at degree 2: {g['per_step_ms']:.1f} ms per step "
          f"({g['collectives_s'] / g['wall_s']:.0%} of the request's time on rank 0, profiled)")
    if args.duration > 0:
        mixed = mixed_load(model, m["degree 1, 1 thread"], args.duration, args.load, args.seed)
        print(f"\n== mixed load: {mixed['requests']} requests at {mixed['rate_rps']:.2f} req/s ({args.load:g} of the "
              f"estimated capacity), over HTTP ==")
        print(f"{'contender':<28}{'done':>6}{'failed':>8}{'p50 ms':>10}{'p95 ms':>10}{'req/s':>8}")
        for label in ("ulysses 2 (one server)", "2 replicas of degree 1"):
            r = mixed[label]
            print(f"{label:<28}{r['done']:>6}{r['failed']:>8}{r['p50_s'] * 1e3:>10.0f}{r['p95_s'] * 1e3:>10.0f}"
                  f"{r['throughput_rps']:>8.2f}")


if __name__ == "__main__":
    main()
