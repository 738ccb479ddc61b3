"""The cost of LoRA adapters per row: one denoising step of 8 rows each with its own adapter against 8 plain rows,
at several ranks, on the embedded model and a tiny SDXL (its benchmark-size channels).

For each model and rank: 8 random adapters of that rank on every attention projection (to_q, to_k, to_v,
to_out.0) are loaded; then rounds alternate (in rotating order) a step of 8 plain requests and a step of the same
8 requests each with a different adapter, through the executor as the engine runs it (guidance on: 16 rows). The
ratio is taken within a round; the table gives the median over --rounds rounds. 1 torch thread.

    .venv/bin/python benchmarks/lora_cost.py --ranks 4,16,64 --rounds 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from stepserve.engine.loading import load_executor
from stepserve.profiling.requests import _dummy_requests, _release
from stepserve.tiny.lora import build_tiny_lora


def measure(model: str, ranks: list[int], rounds: int, batch: int) -> list[dict]:
    executor = load_executor(model, "cpu", "float32", "torch", 1)
    store = executor.adapters()
    folder = Path(tempfile.mkdtemp())
    rows = []
    bucket = (executor.model_info.default_height, executor.model_info.default_width)
    for rank in ranks:
        names = []
        for i in range(batch):
            name = f"r{rank}-{i}"
            store.load(name, build_tiny_lora(model, folder / f"{name}.safetensors", seed=i, rank=rank))
            names.append(name)
        plain = _dummy_requests(executor, batch, bucket, 3.0, f"plain-{rank}")
        adapted = _dummy_requests(executor, batch, bucket, 3.0, f"lora-{rank}")
        executor.prepare(plain)
        executor.prepare(adapted)
        for r, name in zip(adapted, names):
            r.params = replace(r.params, loras=((name, 1.0),))  # as resolve_params leaves a request's adapters
        ratios, t_plain, t_lora = [], [], []
        for k in range(rounds + 2):
            order = [(plain, t_plain), (adapted, t_lora)][:: 1 if k % 2 == 0 else -1]
            times = {}
            for reqs, sink in order:
                for r in reqs:
                    r.step = 0  # the same step every round
                times[id(sink)] = executor.denoise(reqs)
            if k >= 2:  # two warm-up rounds
                t_plain.append(times[id(t_plain)])
                t_lora.append(times[id(t_lora)])
                ratios.append(times[id(t_lora)] / times[id(t_plain)])
        _release(plain + adapted)
        for name in names:
            store.delete(name)
        row = {"model": model, "rank": rank, "rows": 2 * batch, "plain_ms": statistics.median(t_plain) * 1000,
               "lora_ms": statistics.median(t_lora) * 1000, "ratio": statistics.median(ratios),
               "ratio_low": min(ratios), "ratio_high": max(ratios)}
        print(f"{Path(model).name:12} rank {rank:3d}: plain {row['plain_ms']:7.2f} ms, 8 adapters "
              f"{row['lora_ms']:7.2f} ms, ratio {row['ratio']:.2f} ({row['ratio_low']:.2f}-{row['ratio_high']:.2f})",
              flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="embedded,tiny-sdxl", help="embedded, tiny-sdxl (built at bench size), or "
                                                                  "folders")
    p.add_argument("--ranks", default="4,16,64")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for model in args.models.split(","):
        if model == "tiny-sdxl":
            from stepserve.tiny.sdxl import build_tiny_sdxl

            model = str(build_tiny_sdxl(Path(tempfile.mkdtemp()) / "sdxl", channels=(64, 128)))
        rows += measure(model, [int(r) for r in args.ranks.split(",")], args.rounds, args.batch)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
