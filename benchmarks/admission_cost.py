"""How long one admission decision takes under `slo` as the queue grows (the policy replays the queue).

    python benchmarks/admission_cost.py [--queues 10,1000,10000] [--decisions 20]

Every queued request carries a deadline far away, so every decision admits; the queue mixes 8/20/40 steps.
Prints milliseconds per decision (mean over --decisions). The decision runs off the server's event loop
(AsyncEngine.submit_many_off_loop); `stepserve serve` bounds the queue by default (--max-queue), which bounds it.
"""

from __future__ import annotations

import argparse
import random
import time

from stepserve.costs import CostModel, FakeExecutor, LatencyModel
from stepserve.engine.config import EngineOptions
from stepserve.request.types import SamplingParams


def decision_ms(queue: int, decisions: int, max_batch_size: int) -> float:
    latency = LatencyModel.from_cost_model(CostModel())
    core = EngineOptions(strategy="slo", max_batch_size=max_batch_size,
                         latency_model=latency).make_core(FakeExecutor(cost=CostModel()))
    rng = random.Random(0)
    for i in range(queue):
        params = SamplingParams(prompt="queued", seed=i, num_inference_steps=rng.choice([8, 20, 40]), timeout_s=1e6)
        core.enqueue(core.new_request(params, 0.0))
    newcomers = [core.new_request(SamplingParams(prompt="new", seed=i, num_inference_steps=20, timeout_s=1e6), 0.0)
                 for i in range(decisions)]
    start = time.perf_counter()
    for request in newcomers:
        core.check_admission(request, 0.0)
    return (time.perf_counter() - start) / decisions * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queues", default="10,1000,10000", help="queue lengths to measure at")
    ap.add_argument("--decisions", type=int, default=20, help="decisions timed per queue length")
    ap.add_argument("--max-batch-size", type=int, default=8)
    args = ap.parse_args()
    for queue in (int(q) for q in args.queues.split(",")):
        print(f"queue {queue:>6}: {decision_ms(queue, args.decisions, args.max_batch_size):8.2f} ms per admission")


if __name__ == "__main__":
    main()
