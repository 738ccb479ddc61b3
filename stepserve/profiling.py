"""Measuring an executor: a latency model of its stages, and how large a batch fits in memory.

The SLO-aware strategy plans with a LatencyModel (stepserve.scheduling.latency); `stepserve profile` writes one to
a file. Both come from `measure_latency_model`, which runs the executor's own stages on dummy requests and keeps
the durations the executor reports (measured inside the executor, with the device synchronised; the fake
executor reports its cost model's numbers, so a model measured from it is exact).

Memory: `measure_peak_memory` runs one prepare + denoise + decode per batch size and reports the peak bytes it
needed on top of what was allocated before (the weights); `memory_cap` turns such peaks and a budget into the
largest batch size that fits; `cap_max_batch_size` does both for a configured max_batch_size and says why in one
line. What "peak" means depends on the device:

- CUDA: `torch.cuda.max_memory_allocated` over the run, less what was allocated before it: every tensor the run
  created (activations, latents, prompt embeddings, decoded images) at their highest point. Memory that the
  caching allocator keeps reserved but unused, and what CUDA libraries allocate on their own, are not in it.
- CPU: the bytes the torch CPU allocator handed out during the run, at their highest point, from the memory
  events of torch.profiler. Tensors only: memory that libraries allocate on their own (oneDNN or BLAS scratch
  space), Python objects and the C allocator's fragmentation are not counted. The headroom is there for these.

This module is a measuring tool and may read clocks (it times its own run for the metadata); the engine core
never does.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from .executor.base import Executor
from .scheduling.latency import Bucket, Curve, LatencyModel
from .types import Request, RequestStatus, SamplingParams
from .validation import resolve_params

GIB = 1024**3


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


# --- dummy requests -----------------------------------------------------------------------------------------------
def _dummy_requests(executor: Executor, n: int, bucket: Bucket, guidance_scale: float | None, tag: str,
                    seed_base: int = 0) -> list[Request]:
    """`n` requests as EngineCore.add_request makes them (resolved params, model defaults), admitted. Each has
    its own prompt so the text encoder runs on n prompts, and a fixed seed."""
    model = executor.model
    out = []
    for i in range(n):
        params = resolve_params(SamplingParams(prompt=f"profile {tag} {i}", seed=seed_base + i,
                                               guidance_scale=guidance_scale, height=bucket[0], width=bucket[1]),
                                model)
        out.append(Request(
            request_id=f"profile-{tag}-{i}",
            params=params,
            arrival_time=0.0,
            bucket=(params.height, params.width),
            num_steps=params.num_inference_steps,
            deadline=None,
            priority=params.priority,
            status=RequestStatus.RUNNING,
        ))
    return out


def _release(requests: Iterable[Request]) -> None:
    for r in requests:
        r.release_tensors()
        r.image = None


@contextlib.contextmanager
def _no_prompt_cache(executor: Executor) -> Iterator[None]:
    """Run without the pipeline's prompt cache (when it has one), so that every prepare() pays for the text
    encoder (the cost of new prompts) and the profiling prompts do not stay in the cache afterwards."""
    pipeline = getattr(executor, "pipeline", None)
    cache = getattr(pipeline, "prompt_cache", None)
    if cache is None:
        yield
        return
    try:
        pipeline.prompt_cache = type(cache)(capacity=0)
    except Exception:  # noqa: BLE001 - a cache we do not know how to replace: measure with it (prompts are unique)
        yield
        return
    try:
        yield
    finally:
        pipeline.prompt_cache = cache


def _advance(requests: list[Request], executor: Executor) -> None:
    """Move every request one step on, as the engine does after a denoising step; a request that has taken all
    its steps is prepared again (untimed), so the next denoise() stays within its schedule."""
    for r in requests:
        r.step += 1
    if any(r.step >= r.num_steps for r in requests):
        for r in requests:
            r.step = 0
        executor.prepare(requests)


# --- the latency model --------------------------------------------------------------------------------------------
def _device_of(executor: Executor) -> Any:
    return getattr(executor, "device", None)


def _dtype_of(executor: Executor) -> Any:
    dtype = getattr(executor, "dtype", None)
    if dtype is None:
        dtype = getattr(getattr(executor, "pipeline", None), "dtype", None)
    return dtype


def _environment(executor: Executor) -> dict[str, Any]:
    """What the numbers were measured on: executor, device, dtype, library versions."""
    from . import __version__

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
                          guidance_scale: float | None = None, repeats: int = 3, warmup: int = 1,
                          progress: bool | None = None) -> LatencyModel:
    """Measure how long the executor's stages take and return them as a LatencyModel.

    For each bucket (default: the model's default size) and each batch size from profile_batch_sizes(
    max_batch_size), `batch` dummy requests (the model's defaults, guidance `guidance_scale` or the model's
    default, fixed seeds, distinct prompts, no prompt cache) are prepared, then denoised, then decoded, each stage
    `warmup` times unrecorded and `repeats` times recorded; a point is the median of the recorded durations the
    executor returned. Between denoising calls the requests advance one step, as in the engine.

    - step: one denoising forward of `batch` requests (guidance rows as the requests have them; the metadata says
      how many rows per request, `guidance_rows`);
    - encode: prepare() of `batch` new requests (text encoding of their prompts, plus latents and sampler state),
      measured on the reference bucket (the model's default size if measured, else the first bucket);
    - decode: decoding `batch` finished latents.

    The metadata records the device, dtype, library versions, model, settings and, per point, the minimum and
    maximum of the recorded durations (`spread`). Points are kept as measured (not smoothed), so a noisy curve can
    dip slightly as the batch grows.

    `progress`: None or True shows progress (stepserve.progress: a bar on a terminal, a line per phase
    elsewhere); False is silent.

    Time: on the embedded model on CPU (2 threads), the model already loaded, this takes about 0.4 s with
    max_batch_size 8 and about 1.1 s with 16 (defaults: repeats 3, warmup 1).
    """
    sizes = profile_batch_sizes(max_batch_size)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    model = executor.model
    default_bucket = (model.default_height, model.default_width)
    buckets = [default_bucket] if buckets is None else [tuple(b) for b in buckets]
    if not buckets:
        raise ValueError("buckets: give at least one (height, width), or None for the model's default size")
    if len(set(buckets)) != len(buckets):
        raise ValueError(f"buckets: each bucket once, got {buckets}")
    # validate every bucket and the guidance scale up front (a ValidationError names the field)
    probe = [resolve_params(SamplingParams(prompt="profile", seed=0, guidance_scale=guidance_scale, height=h,
                                           width=w), model) for h, w in buckets]
    settings = probe[0]
    reference = default_bucket if default_bucket in buckets else buckets[0]

    step_points: dict[Bucket, list[tuple[int, float]]] = {b: [] for b in buckets}
    decode_points: dict[Bucket, list[tuple[int, float]]] = {b: [] for b in buckets}
    encode_points: list[tuple[int, float]] = []
    spread: dict[str, Any] = {"step": {}, "decode": {}, "encode": []}
    runs = warmup + repeats
    started = time.perf_counter()
    bar = None
    if progress is not False:
        from .progress import progress as progress_bar

        bar = progress_bar(len(buckets) * len(sizes), f"profile {model.name}", "point")
    try:
        with _no_prompt_cache(executor):
            for bucket in buckets:
                key = f"{bucket[0]}x{bucket[1]}"
                for n in sizes:
                    requests: list[Request] = []
                    encode_s = []
                    for k in range(runs):
                        _release(requests)
                        requests = _dummy_requests(executor, n, bucket, guidance_scale, f"{key}-{n}-{k}")
                        encode_s.append(float(executor.prepare(requests)))
                    step_s = []
                    for k in range(runs):
                        if k:
                            _advance(requests, executor)
                        step_s.append(float(executor.denoise(requests)))
                    decode_s = [float(executor.decode(requests)) for _ in range(runs)]
                    _release(requests)
                    for name, samples, points in (("step", step_s, step_points[bucket]),
                                                  ("decode", decode_s, decode_points[bucket])):
                        kept = samples[warmup:]
                        points.append((n, statistics.median(kept)))
                        spread[name].setdefault(key, []).append([n, min(kept), max(kept)])
                    if bucket == reference:
                        kept = encode_s[warmup:]
                        encode_points.append((n, statistics.median(kept)))
                        spread["encode"].append([n, min(kept), max(kept)])
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()

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
        "statistic": "median",
        "sampler": settings.sampler,
        "num_inference_steps": settings.num_inference_steps,
        "guidance_scale": settings.guidance_scale,
        "guidance_rows": 2 if settings.guidance_scale > 1 else 1,
        "encode_bucket": list(reference),
        "prompt_cache": "off (every prompt encoded)",
        "spread": {  # [batch size, min s, max s] of the recorded durations of each point
            "step": [{"bucket": list(b), "points": spread["step"][f"{b[0]}x{b[1]}"]} for b in buckets],
            "decode": [{"bucket": list(b), "points": spread["decode"][f"{b[0]}x{b[1]}"]} for b in buckets],
            "encode": spread["encode"],
        },
    })
    return LatencyModel(
        step={b: Curve(tuple(step_points[b])) for b in buckets},
        encode=Curve(tuple(encode_points)),
        decode={b: Curve(tuple(decode_points[b])) for b in buckets},
        reference_bucket=reference,
        metadata=metadata,
    )


# --- memory -------------------------------------------------------------------------------------------------------
def _run_once(executor: Executor, n: int, bucket: Bucket, tag: str) -> None:
    """One prepare + denoise + decode of `n` requests, then drop their tensors."""
    requests = _dummy_requests(executor, n, bucket, None, tag)
    try:
        executor.prepare(requests)
        executor.denoise(requests)
        executor.decode(requests)
    finally:
        _release(requests)


@contextlib.contextmanager
def _without_profiler_notices() -> Iterator[None]:
    """torch's profiler prints 'USDT ... profiler_start/stop' notices from native code straight to file descriptor 2
    at every start and stop; a server's start-up log should not carry them. Native stderr goes to a temporary file
    meanwhile, and every other line is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept = [line for line in sink.read().decode(errors="replace").splitlines(True) if "USDT" not in line]
            if kept:
                sys.stderr.write("".join(kept))


def _cpu_peak_bytes(executor: Executor, n: int, bucket: Bucket, tag: str) -> int:
    """The highest point of the bytes the torch CPU allocator handed out during one run, above where it began,
    from torch.profiler's memory events (allocations positive, frees negative, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with _without_profiler_notices(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _run_once(executor, n, bucket, tag)
    try:
        events = prof.profiler.kineto_results.events()
        deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"
                        and str(e.device_type()).endswith("CPU"))
    except AttributeError as exc:  # a torch whose profiler does not expose its memory events this way
        raise RuntimeError(f"this torch's profiler does not expose memory events ({exc})") from exc
    live = peak = 0
    for _, nbytes in deltas:
        live += nbytes
        peak = max(peak, live)
    return peak


def measure_peak_memory(executor: Executor, batch_sizes: Iterable[int], bucket: Bucket | None = None
                        ) -> dict[int, int]:
    """Peak bytes needed by one prepare + denoise + decode of each batch size (requests of `bucket`, default the
    model's default size, with the model's default settings), on top of what was allocated before (the weights).

    CUDA: torch.cuda.max_memory_allocated over the run, less what was allocated before it. CPU: the bytes the
    torch CPU allocator handed out at their highest point (torch.profiler memory events); libraries' own scratch
    space, Python objects and allocator fragmentation are not counted. One unrecorded run at the smallest size
    comes first, so one-time allocations (library workspaces) are not charged to a batch size.

    Raises ValueError for an executor without a torch device (the fake executor), and lets an out-of-memory error
    of a batch size propagate (cap_max_batch_size handles it).
    """
    sizes = sorted(set(batch_sizes))
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"batch_sizes must be integers >= 1, got {sizes!r}")
    return dict(_iter_peaks(executor, sizes, bucket))


def _memory_kind(executor: Executor) -> str | None:
    """'cuda' or 'cpu' for an executor on a torch device whose memory can be measured, else None."""
    kind = getattr(_device_of(executor), "type", None)
    return kind if kind in ("cuda", "cpu") else None


def _iter_peaks(executor: Executor, sizes: Sequence[int], bucket: Bucket | None) -> Iterator[tuple[int, int]]:
    """(batch size, peak bytes) for each of `sizes` in turn, after one unrecorded run at the first size."""
    device = _device_of(executor)
    kind = _memory_kind(executor)
    if kind is None:
        raise ValueError(f"peak memory is measured on torch CPU or CUDA executors; {type(executor).__name__} "
                         f"has device {device!r}")
    model = executor.model
    bucket = (model.default_height, model.default_width) if bucket is None else tuple(bucket)
    import torch

    with _no_prompt_cache(executor):
        _run_once(executor, sizes[0], bucket, "memory-warmup")
        for n in sizes:
            tag = f"memory-{n}"
            if kind == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
                _run_once(executor, n, bucket, tag)
                torch.cuda.synchronize(device)
                yield n, max(int(torch.cuda.max_memory_allocated(device)) - int(base), 0)
            else:
                yield n, _cpu_peak_bytes(executor, n, bucket, tag)


def _is_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(exc, oom):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("out of memory", "not enough memory", "can't allocate memory"))


def _peak_at(points: Sequence[tuple[int, float]], n: int) -> float:
    """Peak bytes at batch size n, linear between measured points; past them along the steepest measured slope
    (the conservative choice), and proportional to n when no slope is positive (or one point was measured)."""
    if len(points) == 1:
        n0, b0 = points[0]
        return b0 * n / n0
    for (n0, b0), (n1, b1) in zip(points, points[1:]):
        if n0 <= n <= n1:
            return b0 + (b1 - b0) * (n - n0) / (n1 - n0)
    slopes = [(b1 - b0) / (n1 - n0) for (n0, b0), (n1, b1) in zip(points, points[1:])]
    slope = max(slopes)
    if n < points[0][0]:  # below the first point: down along the first segment, never below 0
        (n0, b0), (n1, b1) = points[0], points[1]
        return max(b0 + (b1 - b0) * (n - n0) / (n1 - n0), 0.0)
    n_last, b_last = points[-1]
    if slope <= 0:
        slope = b_last / n_last
    return b_last + slope * (n - n_last)


def memory_cap(peaks: Mapping[int, float], budget_bytes: float, headroom: float = 0.2) -> int:
    """The largest batch size n such that every size 1..n has a peak (from `peaks`, batch size -> bytes:
    interpolated linearly between measured sizes, extrapolated past them along the steepest measured slope) within
    budget_bytes * (1 - headroom). At least 1, even when nothing fits."""
    if not peaks:
        raise ValueError("peaks: need the peak memory of at least one batch size")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    points = sorted((int(n), float(b)) for n, b in peaks.items())
    if any(n < 1 for n, _ in points) or any(not math.isfinite(b) or b < 0 for _, b in points):
        raise ValueError(f"peaks: batch sizes >= 1 and finite byte counts >= 0, got {dict(peaks)!r}")
    allowed = float(budget_bytes) * (1 - headroom)
    tolerance = 1e-9 * max(abs(allowed), 1.0)
    fits = lambda n: _peak_at(points, n) <= allowed + tolerance  # noqa: E731
    n_last = points[-1][0]
    for n in range(1, n_last + 1):
        if not fits(n):
            return max(n - 1, 1)
    # past the measured sizes the peak grows linearly: solve for the largest n that fits
    slope = _peak_at(points, n_last + 1) - _peak_at(points, n_last)
    if slope <= 0:  # only when every measured peak is 0 bytes: nothing grows, so nothing limits
        return sys.maxsize
    n = n_last + int((allowed + tolerance - _peak_at(points, n_last)) // slope)
    while n > n_last and not fits(n):  # guard against rounding
        n -= 1
    return max(n, 1)


def memory_budget(executor: Executor) -> tuple[int, str]:
    """Bytes the executor's device has free for batches, and what they are.

    CUDA: free device memory (torch.cuda.mem_get_info) plus what torch's caching allocator holds reserved but
    unused. CPU: available host memory (MemAvailable in /proc/meminfo, else free pages from sysconf), and no more
    than the room left under this process's cgroup memory limit when one is set."""
    device = _device_of(executor)
    if getattr(device, "type", None) == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(cached, 0)), f"free on {device}"
    available = _host_available_bytes()
    limit = _cgroup_room_bytes()
    if limit is not None and limit < available:
        return limit, "left under the cgroup memory limit"
    return available, "of available host memory"


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def _cgroup_room_bytes() -> int | None:
    """Bytes left under a cgroup v2 memory limit of this process, or None when there is none we can read."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            path = next((line.strip().split(":", 2)[2] for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current"), encoding="ascii") as f:
            current = int(f.read().strip())
        return max(int(limit) - current, 0)
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def format_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB', in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


CAP_BATCH_SIZES = (1, 2, 4)  # measured by cap_max_batch_size (those <= the requested size); larger are extrapolated


def cap_max_batch_size(executor: Executor, requested_max: int, headroom: float = 0.2,
                       bucket: Bucket | None = None) -> tuple[int, str]:
    """The configured max_batch_size, lowered if a batch that large would not fit in memory, with a one-line
    explanation. Never raises for a too-large request; when memory cannot be measured (the fake executor, an
    unsupported device) the request is kept and the explanation says why.

    The peak is measured (measure_peak_memory) at batch sizes 1, 2 and 4 (those up to `requested_max`) for
    `bucket` — default the largest size the model serves, since any batch may be of it — and extrapolated
    linearly; the budget is memory_budget(), of which `headroom` is kept free.
    """
    if not isinstance(requested_max, int) or isinstance(requested_max, bool) or requested_max < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {requested_max!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    model = executor.model
    if bucket is None:
        bucket = (model.max_size, model.max_size)
    where = f"{bucket[1]}x{bucket[0]}"
    kind = _memory_kind(executor)
    if kind is None:
        return requested_max, (f"max_batch_size {requested_max} kept: {type(executor).__name__} has no torch "
                               f"device whose memory could be measured")
    sizes = [n for n in CAP_BATCH_SIZES if n <= requested_max]
    peaks: dict[int, int] = {}
    ran_out_at = None
    measuring = _iter_peaks(executor, sizes, bucket)
    try:
        while True:
            try:
                n, peak = next(measuring)
            except StopIteration:
                break
            peaks[n] = peak
    except Exception as exc:  # noqa: BLE001 - a failed measurement must not stop the server from starting
        if not _is_out_of_memory(exc):
            return requested_max, (f"max_batch_size {requested_max} kept: peak memory could not be measured "
                                   f"({type(exc).__name__}: {exc})")
        ran_out_at = next((n for n in sizes if n not in peaks), sizes[-1])
    finally:
        measuring.close()
        if kind == "cuda":
            import torch

            torch.cuda.empty_cache()
    budget, what = memory_budget(executor)
    if ran_out_at is not None:
        cap = max(ran_out_at - 1, 1)
        if peaks:
            cap = min(cap, memory_cap(peaks, budget, headroom))
        verdict = f"capped to {cap}" if cap < requested_max else "kept (it cannot go lower)"
        return cap, (f"max_batch_size {requested_max} {verdict}: a batch of {ran_out_at} ({where}) ran out of "
                     f"memory while measuring")
    cap = memory_cap(peaks, budget, headroom)
    biggest = max(peaks)
    detail = (f"{format_bytes(budget)} {what} with {headroom:.0%} headroom ({where}: "
              f"{format_bytes(peaks[biggest])} peak at batch {biggest})")
    if cap >= requested_max:
        return requested_max, f"max_batch_size {requested_max} kept: {requested_max} fits in {detail}"
    if _peak_at(sorted(peaks.items()), cap) > budget * (1 - headroom):
        return cap, f"max_batch_size {requested_max} capped to {cap}: not even {cap} fits in {detail}"
    return cap, f"max_batch_size {requested_max} capped to {cap}: {cap} fits in {detail}"

