"""Two models on one device, shared step by step by the device policy (scheduling.device_share), measured on the
simulated clock against each model served alone at its share of the device (stepserve/sim/fairness.py says how).

Each row: a seeded Poisson trace offering `load` times what the device serves at full batches, half the requests
for the deadline model (its own steps, every request with a deadline), half for the batch model (no deadline),
one strategy on both engines (max batch 8). Printed: the shares (from the weights), the deadline model's
attainment shared and alone at its share, the batch model's requests completed while arrivals came (shared over
alone at its share), each model's fraction of the device in that time, and the longest any step waited for the
device against the bound (aging + the longest step). PASS: within 5 points, at least 0.9, within the bound.

Pairs of curves (stepserve/models/latency): sd15 = gpu-sd15-512, both models; sd15/sub = drafts on gpu-sd15-512,
finals on gpu-512-sublinear (a 20B DiT at 512); sd15/cb = drafts on SD 1.5, finals on gpu-1024-compute-bound.

    python benchmarks/models_share.py [--pairs sd15,sd15/sub] [--loads 0.9,1.2,1.5] [--weights 1,3]
        [--strategies continuous,slo] [--deadline-steps 8,20] [--duration 300] [--seed 0] [--slo-at-full-device]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from stepserve.costs import LatencyModel
from stepserve.sim.fairness import BATCH, DEADLINE, FairnessCase, measure

ROOT = Path(__file__).resolve().parent.parent
CURVES = {"sd15": "gpu-sd15-512", "sub": "gpu-512-sublinear", "cb": "gpu-1024-compute-bound"}
TIMEOUT_S = {8: 2.0, 20: 4.0}  # the deadline model's deadline, by its steps (about 4x its steps alone at full batch)


def curve(name: str) -> LatencyModel:
    return LatencyModel.load(ROOT / "stepserve/models/latency" / f"{CURVES[name]}.json")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default="sd15,sd15/sub,sd15/cb")
    p.add_argument("--loads", default="0.9,1.2,1.5")
    p.add_argument("--weights", default="1,3", help="the batch model's weights (the deadline model's is 1)")
    p.add_argument("--strategies", default="continuous,slo")
    p.add_argument("--deadline-steps", default="8,20", help="the deadline model's steps (the batch model's: 20)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals per row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-at-full-device", action="store_true",
                   help="slo as before it planned at its share: each model's policy predicts at the whole device's "
                        "speed although it gets only its share while the other model has work")
    args = p.parse_args()
    print(f"{'pair':<9} {'strategy':<10} {'dl steps':>8} {'shares':>9} {'load':>5}  {'attain':>6} {'alone':>6} "
          f"{'gap':>6}  {'batch done':>11} {'ratio':>5}  {'device':>9}  {'wait/bound':>10}  verdict", flush=True)
    for pair in args.pairs.split(","):
        first, _, second = pair.partition("/")
        deadline, batch = curve(first), curve(second or first)
        for strategy in args.strategies.split(","):
            for steps in [int(x) for x in args.deadline_steps.split(",")]:
                for weight in [float(x) for x in args.weights.split(",")]:
                    for load in [float(x) for x in args.loads.split(",")]:
                        t0 = time.perf_counter()
                        f = measure(FairnessCase(deadline, batch, load=load, timeout_s=TIMEOUT_S.get(steps, 4.0),
                                                 deadline_steps=steps, batch_steps=20, duration_s=args.duration,
                                                 seed=args.seed, strategy=strategy, plan_shares=not args.slo_at_full_device,
                                                 weights={DEADLINE: 1.0, BATCH: weight}))
                        frac = f.device_frac
                        print(f"{pair:<9} {strategy:<10} {steps:>8} {f.shares[DEADLINE]:>4.2f}/{f.shares[BATCH]:.2f} "
                              f"{load:>5.2f}  {f.attainment_shared:>6.3f} {f.attainment_alone:>6.3f} "
                              f"{f.attainment_gap:>+6.3f}  {f.batch_done_shared:>5}/{f.batch_done_alone:<5} "
                              f"{f.batch_ratio:>5.2f}  {frac[DEADLINE]:.2f}/{frac[BATCH]:.2f}  "
                              f"{f.max_wait_s:>4.2f}/{f.wait_bound_s:<4.2f}  {'PASS' if f.passes else 'FAIL'} "
                              f"[{time.perf_counter() - t0:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
