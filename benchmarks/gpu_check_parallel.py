"""gpu_check's parallel rows: one request split over two devices against the same request on one (docs/SCALING.md).

On a machine with two CUDA devices: a benchmark-sized tiny Flux.1 with --ulysses-degree 2, --ring-degree 2 and
--tensor-parallel-size 2, and a benchmark-sized tiny SD 1.x with --cfg-parallel; each row generates the same three
requests (mixed sizes, steps and guidance) as the degree-1 engine and reports the largest pixel difference (uint8)
and the seconds of one request at each degree. With --smoke on a CPU: the Ulysses and CFG rows over gloo (two
ranks, one thread each). Rows that cannot run say why (a note) and are not checks."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REQUESTS = ({"prompt": "a red fox in snow", "width": 64, "height": 64, "num_inference_steps": 4, "seed": 1,
             "guidance_scale": 3.5},
            {"prompt": "a lighthouse", "width": 64, "height": 32, "num_inference_steps": 6, "seed": 2,
             "guidance_scale": 5.0},
            {"prompt": "a boat", "width": 64, "height": 64, "num_inference_steps": 3, "seed": 3,
             "guidance_scale": 1.0})


def _images(engine) -> tuple[list[np.ndarray], float]:
    from stepserve import SamplingParams

    engine.generate([SamplingParams(**REQUESTS[0])])  # warm
    t0 = time.perf_counter()
    outs = engine.generate([SamplingParams(**r) for r in REQUESTS])
    seconds = time.perf_counter() - t0
    bad = [o.error for o in outs if not o.ok]
    if bad:
        raise RuntimeError(bad[0])
    return [np.asarray(o.image).astype(int) for o in outs], seconds


def parallel_rows(device: str, dtype: str, smoke: bool, check, notes: list[str]) -> list[dict]:
    from stepserve import Engine
    from stepserve.parallel.degrees import Degrees
    from stepserve.parallel.ranks import RanksLost
    from stepserve.tiny.flux import BENCH_OPTIONS, build_tiny_flux
    from stepserve.tiny.sd import build_tiny_sd

    on_cuda = device.startswith("cuda")
    if on_cuda and torch.cuda.device_count() < 2:
        notes.append(f"parallel: not run (degree 2 needs two CUDA devices; {torch.cuda.device_count()} visible)")
        return []
    root = Path(tempfile.mkdtemp(prefix="gpu-check-parallel-"))
    flux = build_tiny_flux(root / "flux", **BENCH_OPTIONS)
    sd = build_tiny_sd(root / "sd", sample_size=16)
    cases = [("ulysses 2", flux, Degrees(ulysses=2)), ("cfg parallel", sd, Degrees(cfg=True))]
    if on_cuda:
        cases += [("ring 2", flux, Degrees(ring=2)), ("tensor parallel 2", flux, Degrees(tensor=2))]
    else:
        notes.append("parallel: ring 2 and tensor parallel 2 run on CUDA devices only (see `stepserve serve "
                     "--ring-degree 2 --device cpu` for why)")
    limit = 1 if dtype == "float32" else 8  # uint8 levels: rounding of the split forward's reductions
    rows, single = [], {}
    for name, folder, degrees in cases:
        threads = {"threads": 1} if not on_cuda else {}
        try:
            if folder not in single:
                one = Engine.from_pretrained(str(folder), device=device, dtype=dtype, memory_cap=False, **threads)
                single[folder] = _images(one)
                del one
            split = Engine.from_pretrained(str(folder), device=device, dtype=dtype, memory_cap=False,
                                           degrees=degrees, **threads)
            try:
                images, seconds = _images(split)
            finally:
                split.executor.close()
        except (Exception, RanksLost) as exc:  # noqa: BLE001 - a row that cannot run is a note, the others run
            notes.append(f"parallel {name}: not run: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        ref, ref_s = single[folder]
        diff = max(int(np.abs(a - b).max()) for a, b in zip(images, ref))
        check(f"parallel {name} vs one device, max uint8 diff", diff, limit)
        rows.append({"case": name, "max_uint8_diff": diff, "one_device_s": ref_s, "split_s": seconds,
                     "speedup": ref_s / seconds})
    return rows
