"""The default (slo) against continuous batching on the embedded model, in process, in alternating pairs: each
pair replays one Poisson trace (8/20/40 steps) to both, the order flipping every pair, one torch thread; per run
p50 / p95 of the request latency (arrival to answer), engine steps, mean batch and busy seconds; then the medians
and the ratio of each pair. The single-round comparisons (make demo) swing both ways on a shared 2-core machine;
this shows by how much.

    .venv/bin/python benchmarks/slo_vs_continuous.py RATE SECONDS PAIRS     # e.g. 12 20 5
"""

import asyncio
import collections
import random
import statistics as st
import sys
import time

import torch

from stepserve import SamplingParams
from stepserve.engine.async_engine import AsyncEngine
from stepserve.engine.config import resolve_latency_model
from stepserve.engine.loading import load_executor


async def run(strat, seed):
    eng = AsyncEngine(ex, strategy=strat, max_batch_size=8, **({"latency_model": lm} if strat == "slo" else {}))
    steps = []
    eng.on_step.append(lambda r: steps.append((r.batch_size, r.denoise_s, len(r.admitted), r.duration_s)) if r.batch_size else None)
    await eng.start()
    rng = random.Random(seed)
    arrivals = []
    t = 0
    while t < DUR:
        t += rng.expovariate(RATE)
        arrivals.append((t, rng.randrange(10**6), rng.choice([8, 20, 40])))
    t0 = time.monotonic(); handles = []
    for at, s, n in arrivals:
        await asyncio.sleep(max(0, t0 + at - time.monotonic()))
        handles.append((t0 + at, eng.submit(SamplingParams(prompt="a seven", seed=s, num_inference_steps=n))))
    lat = []
    for _, h in handles:
        r = await h.result()
        lat.append(r.timing.total_s)
    await eng.shutdown()
    lat.sort()
    return lat[len(lat)//2], lat[int(0.95*len(lat))], len(steps), st.mean(b for b, *_ in steps), sum(d for *_, d in steps)

async def main():
    res = collections.defaultdict(list)
    for i in range(int(sys.argv[3])):
        order = ["slo", "continuous"] if i % 2 == 0 else ["continuous", "slo"]
        for s in order:
            p50, p95, n, mb, busy = await run(s, i)
            res[s].append((p50, p95))
            print(f"pair {i} {s:10} p50 {p50*1000:6.0f} ms p95 {p95*1000:6.0f} ms steps {n} mean batch {mb:.2f} busy {busy:.1f} s", flush=True)
    for s, v in res.items():
        print(s, "median p50 %.0f ms p95 %.0f ms" % (1000*st.median(a for a, _ in v), 1000*st.median(b for _, b in v)))
    r = [a[0]/b[0] for a, b in zip(res["slo"], res["continuous"])]
    print("slo/continuous p50 per pair:", [round(x, 2) for x in r])
if __name__ == "__main__":
    torch.set_num_threads(1)
    ex = load_executor("embedded")
    lm = resolve_latency_model(None, ex, 8)  # the slo runs predict with it, measured once
    RATE, DUR = float(sys.argv[1]), float(sys.argv[2])
    asyncio.run(main())
