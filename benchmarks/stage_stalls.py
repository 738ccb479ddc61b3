"""Stage stalls: how much prompt encoding and VAE decoding inside an engine step lengthen that step, and what
bounding the decodes per step (EngineCore max_decode_per_step) does to step times and request latency.

Every request in a step waits for the whole step, so a step that also encodes newly admitted prompts or decodes
finished images is a latency spike for every running request. The same seeded open-loop trace (mixed step counts,
Poisson arrivals) is replayed in process against continuous batching with each decode bound in turn, the runs
interleaved over --repeats rounds. Printed per setting: step-time p50 / p99 / max, the share of steps that are
spikes (> 1.5x the median step at that batch size), the mean encode and decode time inside a step that has any,
and request latency p50 / p95.

    python benchmarks/stage_stalls.py [--model embedded] [--rate 8] [--duration 20] [--bounds none,1,2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from common import pick_model


@dataclass
class Run:
    bound: int | None
    # one tuple per step: (duration, encode, denoise, decode, batch size, images decoded)
    steps: list = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))] if values else float("nan")


async def replay(executor, trace, bound: int | None, max_batch: int, warmup_s: float) -> Run:
    from stepserve.engine.async_engine import AsyncEngine

    run = Run(bound)
    engine = AsyncEngine(executor, strategy="continuous", max_batch_size=max_batch, max_decode_per_step=bound)
    t0_holder = {}

    def record(report):
        if report.duration_s > 0 and report.now - t0_holder["t0"] >= warmup_s:
            decoded = sum(1 for r in report.finished if r.timing.denoise_done is not None)
            run.steps.append((report.duration_s, report.encode_s, report.denoise_s, report.decode_s,
                              report.batch_size, decoded))

    engine.on_step.append(record)
    await engine.start()
    t0 = time.monotonic()
    t0_holder["t0"] = t0

    async def one(offset: float, params) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
        handle = engine.submit(params)
        result = await handle.result()
        if offset >= warmup_s and result.ok:
            run.latencies.append(time.monotonic() - (t0 + offset))

    await asyncio.gather(*(one(offset, params) for offset, params in trace))
    await engine.shutdown(5.0)
    return run


def make_trace(rate: float, duration: float, steps: list[int], seed: int):
    from stepserve.util.digits import DIGIT_PROMPTS
    from stepserve.request.types import SamplingParams

    rng = random.Random(seed)
    t, out, i = 0.0, [], 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append((t, SamplingParams(prompt=rng.choice(DIGIT_PROMPTS), seed=i, num_inference_steps=rng.choice(steps))))
        i += 1


def summarize(runs: list[Run]) -> dict:
    steps = [s for r in runs for s in r.steps]
    by_batch: dict[int, list[float]] = {}
    for d, _, _, _, b, _ in steps:
        by_batch.setdefault(b, []).append(d)
    median_at = {b: statistics.median(v) for b, v in by_batch.items()}
    spikes = sum(1 for d, _, _, _, b, _ in steps if d > 1.5 * median_at[b])
    encodes = [s[1] for s in steps if s[1] > 0]
    decodes = [s[3] for s in steps if s[3] > 0]
    decoded = [s[5] for s in steps if s[3] > 0]
    lat = [v for r in runs for v in r.latencies]
    durations = [d for d, *_ in steps]
    return {
        "steps": len(steps), "step_p50_ms": 1000 * pct(durations, 0.5), "step_p99_ms": 1000 * pct(durations, 0.99),
        "step_max_ms": 1000 * max(durations), "spike_share": spikes / max(1, len(steps)),
        "encode_in_step_ms": 1000 * statistics.mean(encodes) if encodes else 0.0,
        "decode_in_step_ms": 1000 * statistics.mean(decodes) if decodes else 0.0,
        "images_per_decode_step": statistics.mean(decoded) if decoded else 0.0,
        "max_images_per_decode_step": max(decoded, default=0),
        "latency_p50_ms": 1000 * pct(lat, 0.5), "latency_p95_ms": 1000 * pct(lat, 0.95), "completed": len(lat),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--steps", default="8,20,40")
    p.add_argument("--bounds", default="none,1,2", help="max_decode_per_step settings; none = decode all")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from stepserve.engine.loading import load_executor

    executor = load_executor(pick_model(args.model))
    bounds = [None if b == "none" else int(b) for b in args.bounds.split(",")]
    trace = make_trace(args.rate, args.duration, [int(s) for s in args.steps.split(",")], args.seed)
    print(f"{len(trace)} requests over {args.duration:g} s per run; bounds {args.bounds}; {args.repeats} rounds",
          flush=True)
    runs: dict[str, list[Run]] = {str(b): [] for b in bounds}
    for repeat in range(args.repeats):
        order = bounds[repeat % len(bounds):] + bounds[:repeat % len(bounds)]
        for b in order:
            runs[str(b)].append(asyncio.run(replay(executor, trace, b, args.max_batch_size, args.warmup)))
            print(f"  round {repeat + 1}: max_decode_per_step={b} done", flush=True)
    table = {label: summarize(rs) for label, rs in runs.items()}
    print(f"\n{'max_decode_per_step':>20} {'step p50':>9} {'p99':>7} {'max':>7} {'spikes':>7} {'enc/step':>9} "
          f"{'dec/step':>9} {'img/dec':>8} {'lat p50':>8} {'lat p95':>8}")
    for label, s in table.items():
        print(f"{label:>20} {s['step_p50_ms']:9.1f} {s['step_p99_ms']:7.1f} {s['step_max_ms']:7.1f} "
              f"{s['spike_share']:7.1%} {s['encode_in_step_ms']:9.1f} {s['decode_in_step_ms']:9.1f} "
              f"{s['images_per_decode_step']:8.2f} "
              f"{s['latency_p50_ms']:8.0f} {s['latency_p95_ms']:8.0f}")
    print(json.dumps(table))


if __name__ == "__main__":
    main()
