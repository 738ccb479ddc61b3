"""What the web console costs the engine: step time and latency at 70% load with no viewer and with viewers of
the live batch view connected (/v1/engine/events), side by side on one server.

1. The engine thread's own cost per step while a viewer is connected: EngineEvents.on_step (build the record,
   hand it to the viewer's loop) for a step of 8 requests, timed in process.
2. `stepserve serve` on the model (its default strategy), then `stepserve bench --target` measures its capacity.
3. Rounds of one Poisson trace at --rate-frac of it, alternating: no viewer, then N viewers (each a separate
   process at the lowest CPU priority that reads and parses every batch of step records as the page does: a
   viewer's own CPU is normally another machine's), then no viewer... (the order flips every round).
4. Per run: the engine's mean step time from /metrics (stepserve_step_latency_seconds sum / count over the run)
   and the bench's p50 / p95; printed as medians over the rounds, with the viewer runs' ratios.

    .venv/bin/python benchmarks/console_overhead.py [--model embedded] [--rounds 3] [--viewers 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

from common import (
    ROOT,
    add_run_args,
    free_port,
    stepserve,
    stop_server,
    summaries,
    wait_until_healthy,
)


def step_totals(url: str) -> tuple[float, float]:
    """(sum, count) of the server's step-time histogram."""
    values = {}
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            name, _, value = line.partition(" ")
            if name in ("stepserve_step_latency_seconds_sum", "stepserve_step_latency_seconds_count"):
                values[name] = float(value)
    return values["stepserve_step_latency_seconds_sum"], values["stepserve_step_latency_seconds_count"]


VIEWER = """
import json, signal, sys, httpx
records = 0
def done(*_):
    print(records, flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
with httpx.stream("GET", sys.argv[1] + "/v1/engine/events", timeout=None) as answer:
    for line in answer.iter_lines():
        if line.startswith("data:"):
            batch = json.loads(line[5:])
            records += len(batch) if isinstance(batch, list) else 0
"""


class Viewer:
    """A process at nice 19 that reads /v1/engine/events and parses every record until stopped."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", VIEWER, url], stdout=subprocess.PIPE,
                                     text=True)
        self.records = 0

    def close(self) -> None:
        self.proc.terminate()
        out, _ = self.proc.communicate(30)
        self.records = int(out.strip() or 0)


def engine_thread_cost(rows: int = 8, steps: int = 20_000) -> float:
    """Seconds EngineEvents.on_step takes in the engine thread for a step of `rows` requests, one viewer."""
    import asyncio
    import time

    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.costs.fake import FakeExecutor
    from stepserve.server.events import EngineEvents
    from stepserve.request.types import SamplingParams, StepReport
    from stepserve.request.validation import resolve_params

    engine = AsyncEngine(FakeExecutor(), strategy="continuous")
    requests = [engine.core.new_request(resolve_params(SamplingParams(prompt=f"p{i}", seed=i), engine.model_info),
                                        0.0, f"request-{i}", frozenset()) for i in range(rows)]
    for r in requests:
        r.step = 7
    report = StepReport(now=1.0, duration_s=0.02, batch_size=rows, progressed=requests)
    hub = EngineEvents(engine)

    async def run() -> float:
        queue = hub.subscribe()
        start = time.perf_counter()
        for _ in range(steps):
            hub.on_step(report)
        spent = time.perf_counter() - start
        await asyncio.sleep(0)
        hub.unsubscribe(queue)
        return spent / steps

    return asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p, "bench-out/console-overhead", duration_s=20.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--viewers", type=int, default=1)
    p.add_argument("--rate-frac", type=float, default=0.7)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    per_step = engine_thread_cost(args.max_batch_size)
    print(f"engine thread, per step of {args.max_batch_size} requests with a viewer: {per_step * 1e6:.1f} us")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.out / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "stepserve.cli", "serve", "--model", args.model, "--port",
                                   str(port), "--threads", str(args.threads), "--max-batch-size",
                                   str(args.max_batch_size), "--no-access-log"], cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(server, url, "serve", 300, log=str(log))
        common = ["--target", url, "--steps", args.steps, "--seed", str(args.seed), "--warmup", str(args.warmup),
                  "--no-progress"]
        stepserve("bench", *common, "--duration", "5", "--rate-frac", str(args.rate_frac),
                  "--out", str(args.out / "capacity"))
        capacity = json.loads((args.out / "capacity" / "results.json").read_text())["capacity"]["rps"]
        rate = args.rate_frac * capacity
        rows = {"none": [], "viewers": []}
        for i in range(args.rounds):
            for mode in (("none", "viewers") if i % 2 == 0 else ("viewers", "none")):
                viewers = [Viewer(url) for _ in range(args.viewers if mode == "viewers" else 0)]
                before = step_totals(url)
                run = args.out / f"{mode}-{i}"
                stepserve("bench", *common, "--duration", str(args.duration), "--rate", f"{rate:.6f}",
                          "--out", str(run))
                after = step_totals(url)
                for v in viewers:
                    v.close()
                summary = next(iter(summaries(run).values()))
                step_s = (after[0] - before[0]) / max(1.0, after[1] - before[1])
                rows[mode].append({"step_s": step_s, "p50_s": summary["p50_s"]["median"],
                                   "p95_s": summary["p95_s"]["median"], "records": sum(v.records for v in viewers)})
                print(f"round {i} {mode:8} mean step {step_s * 1000:6.2f} ms  p50 {rows[mode][-1]['p50_s'] * 1000:5.0f} ms"
                      f"  p95 {rows[mode][-1]['p95_s'] * 1000:5.0f} ms  records read {rows[mode][-1]['records']}")
    finally:
        stop_server(server)
    print(f"\n{args.model}: {rate:.2f} req/s ({args.rate_frac:.0%} of capacity {capacity:.2f} req/s), "
          f"{args.viewers} viewer(s); medians over {args.rounds} rounds")
    result = {"rate_rps": rate, "capacity_rps": capacity, "viewers": args.viewers,
              "engine_thread_s_per_step": per_step}
    for key in ("step_s", "p50_s", "p95_s"):
        a = statistics.median(r[key] for r in rows["none"])
        b = statistics.median(r[key] for r in rows["viewers"])
        result[key] = {"no_viewer": a, "viewers": b, "ratio": b / a,
                       "spread_no_viewer": [min(r[key] for r in rows["none"]), max(r[key] for r in rows["none"])]}
        print(f"{key[:-2]:5}: no viewer {a * 1000:7.2f} ms   viewer(s) {b * 1000:7.2f} ms   ratio {b / a:.3f}"
              f"   (no-viewer rounds {min(r[key] for r in rows['none']) * 1000:.2f}-"
              f"{max(r[key] for r in rows['none']) * 1000:.2f} ms)")
    Path(args.out / "console_overhead.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
