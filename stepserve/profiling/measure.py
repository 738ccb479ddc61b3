"""Measuring an executor's stages into a LatencyModel, from the durations it reports on dummy requests; with and
without guidance rows (stepserve.costs.guidance keeps both in the model's metadata)."""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..costs.guidance import METADATA_KEY, guidance_entry
from ..costs.latency_model import Bucket, Curve, LatencyModel
from ..executor.base import Executor
from ..request.buckets import bucket_fields, default_bucket
from ..request.types import Request
from ..request.validation import internal_params
from .requests import (
    _advance,
    _device_of,
    _dtype_of,
    _dummy_requests,
    _no_prompt_cache,
    _release,
)


# --- which batch sizes to measure ---------------------------------------------------------------------------------
def profile_batch_sizes(max_batch_size: int) -> list[int]:
    """Every size 1..max_batch_size when it is at most 16; else 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, ...
    (powers of two and the points half-way between them), up to and including max_batch_size."""
    if not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    if max_batch_size <= 16:
        return list(range(1, max_batch_size + 1))
    sizes = {1, 2, 3}
    p = 4
    while p <= max_batch_size:
        sizes.add(p)
        if p + p // 2 <= max_batch_size:
            sizes.add(p + p // 2)
        p *= 2
    sizes.add(max_batch_size)
    return sorted(sizes)


def _environment(executor: Executor) -> dict[str, Any]:
    """What the numbers were measured on: executor, device, dtype, library versions."""
    from ..version import __version__

    meta: dict[str, Any] = {"executor": type(executor).__name__, "stepserve": __version__,
                            "python": platform.python_version(), "platform": platform.platform()}
    device, dtype = _device_of(executor), _dtype_of(executor)
    if device is not None:
        meta["device"] = str(device)
    if dtype is not None:
        meta["dtype"] = str(dtype).removeprefix("torch.")
    torch = sys.modules.get("torch")
    if torch is not None:
        meta["torch"] = torch.__version__
        if device is not None and getattr(device, "type", None) == "cuda":
            meta["device_name"] = torch.cuda.get_device_name(device)
        elif device is not None and getattr(device, "type", None) == "cpu":
            meta["threads"] = torch.get_num_threads()
    return meta


def measure_latency_model(executor: Executor, max_batch_size: int, buckets: Sequence[Bucket] | None = None,
                          guidance_scale: float | None = None, repeats: int = 5, warmup: int = 1,
                          progress: bool | None = None, rounds: int = 1, statistic: str = "median") -> LatencyModel:
    """Measure how long the executor's stages take and return them as a LatencyModel.

    For each bucket (default: the model's default size) and each batch size from profile_batch_sizes(
    max_batch_size), `batch` dummy requests (the model's defaults, guidance `guidance_scale` or the model's
    default, fixed seeds, distinct prompts, no prompt cache) are prepared, then denoised, then decoded, each stage
    `warmup` times unrecorded and `repeats` times recorded; a point is the `statistic` ("median" or "mean") of the
    recorded durations the executor returned. Between denoising calls the requests advance one step, as in the
    engine. `rounds` > 1 sweeps every point that many times in turn and pools their samples, so a slow spell of the
    machine spreads over all points instead of bending a few of them.

    Which statistic: a queue's load is the mean service time times the arrival rate, so a latency model meant to
    predict latency under load (`stepserve simulate`, `stepserve plan`) should charge the mean; the median ignores
    the occasional slow step (a page fault, the OS taking the core) that every live run also pays.

    - step: one denoising forward of `batch` requests (guidance rows as the requests have them; the metadata says
      how many rows per request, `guidance_rows`);
    - encode: prepare() of `batch` new requests (text encoding of their prompts, plus latents and sampler state),
      measured on the reference bucket (the model's default size if measured, else the first bucket);
    - decode: decoding `batch` finished latents.

    The metadata records the device, dtype, library versions, model, settings and, per point, the minimum and
    maximum of the recorded durations (`spread`). A larger batch never costs less, so each curve is made
    non-decreasing in batch size by pooling adjacent violators (a dip is averaged with the point before it);
    a curve that was already non-decreasing (any real cost model, the fake executor's) is kept exactly.

    `progress`: None or True shows progress (stepserve.util.progress: a bar on a terminal, a line per phase
    elsewhere); False is silent.

    Time: on the embedded model on CPU (2 threads), the model already loaded, this takes about 0.4 s with
    max_batch_size 8 and about 1.1 s with 16 (defaults: repeats 3, warmup 1).
    """
    sizes = profile_batch_sizes(max_batch_size)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic must be one of {tuple(_STATISTICS)}, got {statistic!r}")
    summary = _STATISTICS[statistic]
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    model = executor.model_info
    default = default_bucket(model)
    buckets = [default] if buckets is None else [tuple(b) for b in buckets]
    if not buckets:
        raise ValueError("buckets: give at least one (height, width) (video: (frames, height, width)), or None for "
                         "the model's default size")
    if len(set(buckets)) != len(buckets):
        raise ValueError(f"buckets: each bucket once, got {buckets}")
    # validate every bucket and the guidance scale up front (a ValidationError names the field)
    probe = [internal_params(model, prompt="profile", seed=0, guidance_scale=guidance_scale, **bucket_fields(b))
             for b in buckets]
    settings = probe[0]
    reference = default if default in buckets else buckets[0]

    step_s: dict[tuple[Bucket, int], list[float]] = {(b, n): [] for b in buckets for n in sizes}
    decode_s: dict[tuple[Bucket, int], list[float]] = {(b, n): [] for b in buckets for n in sizes}
    encode_s: dict[int, list[float]] = {n: [] for n in sizes}
    runs = warmup + repeats
    started = time.perf_counter()
    bar = None
    if progress is not False:
        from ..util.progress import progress as progress_bar

        # one measurement: one size at one batch size in one round (its warm-up and repeats included)
        bar = progress_bar(rounds * len(buckets) * len(sizes), f"profile {model.name}", "measurement")
    try:
        with _no_prompt_cache(executor):
            for r in range(rounds):
                for bucket in buckets:
                    key = "x".join(map(str, bucket))
                    for n in sizes:
                        requests: list[Request] = []
                        encoded = []
                        for k in range(runs):
                            _release(requests)
                            requests = _dummy_requests(executor, n, bucket, guidance_scale, f"{key}-{n}-{r}-{k}")
                            encoded.append(float(executor.prepare(requests)))
                        stepped = []
                        for k in range(runs):
                            if k:
                                _advance(requests, executor)
                            stepped.append(float(executor.denoise(requests)))
                        decoded = [float(executor.decode(requests)) for _ in range(runs)]
                        _release(requests)
                        step_s[bucket, n] += stepped[warmup:]
                        decode_s[bucket, n] += decoded[warmup:]
                        if bucket == reference:
                            encode_s[n] += encoded[warmup:]
                        if bar is not None:
                            bar.update(1)
    finally:
        if bar is not None:
            bar.close()

    def points(samples: dict, keys) -> list[tuple[int, float]]:
        return [(n, summary(samples[k])) for n, k in keys]

    def ranges(samples: dict, keys) -> list[list]:
        return [[n, min(samples[k]), max(samples[k])] for n, k in keys]

    step_points = {b: points(step_s, [(n, (b, n)) for n in sizes]) for b in buckets}
    decode_points = {b: points(decode_s, [(n, (b, n)) for n in sizes]) for b in buckets}
    encode_points = points(encode_s, [(n, n) for n in sizes])
    spread: dict[str, Any] = {
        "step": {b: ranges(step_s, [(n, (b, n)) for n in sizes]) for b in buckets},
        "decode": {b: ranges(decode_s, [(n, (b, n)) for n in sizes]) for b in buckets},
        "encode": ranges(encode_s, [(n, n) for n in sizes]),
    }

    metadata = _environment(executor)
    metadata.update({
        "source": "stepserve.profiling.measure_latency_model",
        "model": model.name,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - started, 3),
        "max_batch_size": max_batch_size,
        "batch_sizes": sizes,
        "buckets": [list(b) for b in buckets],
        "repeats": repeats,
        "warmup": warmup,
        "rounds": rounds,
        "statistic": statistic,
        "smoothing": "non-decreasing in batch size (pool adjacent violators)",
        "sampler": settings.sampler,
        "num_inference_steps": settings.num_inference_steps,
        "guidance_scale": settings.guidance_scale,
        "guidance": model.guidance,  # "embedded": the scale is a value the denoiser reads, never an extra row
        "guidance_rows": 2 if settings.guidance_scale > 1 and model.guidance == "cfg" else 1,
        "encode_bucket": list(reference),
        "prompt_cache": "off (every prompt encoded)",
        "spread": {  # [batch size, min s, max s] of the recorded durations of each point
            "step": [{"bucket": list(b), "points": spread["step"][b]} for b in buckets],
            "decode": [{"bucket": list(b), "points": spread["decode"][b]} for b in buckets],
            "encode": spread["encode"],
        },
    })
    return LatencyModel(
        step={b: Curve(non_decreasing(step_points[b])) for b in buckets},
        encode=Curve(non_decreasing(encode_points)),
        decode={b: Curve(non_decreasing(decode_points[b])) for b in buckets},
        reference_bucket=reference,
        metadata=metadata,
    )


def measure_with_and_without_guidance(executor: Executor, max_batch_size: int,
                                      buckets: Sequence[Bucket] | None = None,
                                      guidance_scale: float | None = None, repeats: int = 5, warmup: int = 1,
                                      progress: bool | None = None, rounds: int = 1,
                                      statistic: str = "median") -> LatencyModel:
    """measure_latency_model twice: with guidance (`guidance_scale`, default the model's own when it is > 1, else
    2.0) and without (scale 1.0). The model's curves are those of the rows a request at the model's default
    guidance runs; both measurements go to `metadata["by_guidance_rows"]` (see the module docstring). A model whose
    guidance is embedded (ModelInfo.guidance, e.g. Flux.1 dev) runs one row per request either way: measured
    once."""
    model = executor.model_info
    if model.guidance != "cfg":  # every request is one row whatever its scale: one measurement says it all
        return measure_latency_model(executor, max_batch_size, buckets, guidance_scale, repeats, warmup, progress,
                                     rounds=rounds, statistic=statistic)
    if guidance_scale is None:
        guidance_scale = model.default_guidance_scale if model.default_guidance_scale > 1 else 2.0
    if not guidance_scale > 1:
        raise ValueError(f"guidance_scale must be > 1 (the scale of the measurement with guidance rows; the one "
                         f"without is always made too), got {guidance_scale!r}")
    measured: dict[int, LatencyModel] = {}
    for rows, scale in ((2, guidance_scale), (1, 1.0)):
        if progress is not False:
            print(f"profile {model.name}: {'with guidance rows' if rows == 2 else 'without guidance'} "
                  f"(guidance_scale {scale:g})", file=sys.stderr, flush=True)
        measured[rows] = measure_latency_model(executor, max_batch_size, buckets, scale, repeats, warmup, progress,
                                               rounds=rounds, statistic=statistic)
    main_rows = 2 if model.default_guidance_scale > 1 else 1
    main = measured[main_rows]
    metadata = dict(main.metadata)
    metadata["wall_s"] = round(sum(m.metadata.get("wall_s", 0.0) for m in measured.values()), 3)
    metadata["guidance_scale_default"] = model.default_guidance_scale
    metadata[METADATA_KEY] = {str(rows): guidance_entry(m) for rows, m in sorted(measured.items())}
    return LatencyModel(step=main.step, encode=main.encode, decode=main.decode,
                        reference_bucket=main.reference_bucket, metadata=metadata)


_STATISTICS = {"median": statistics.median, "mean": statistics.fmean}


def non_decreasing(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """Least-squares non-decreasing fit of (x, y) points sorted by x: pool adjacent violators, each pooled block
    taking the mean of its points. Non-decreasing input comes back unchanged."""
    blocks: list[list[float]] = []  # [sum, count] per block
    for _, y in points:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return tuple((x, y) for (x, _), y in zip(points, fitted))
