"""Peak memory per batch size, and the largest batch that fits."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

from ..costs.latency_model import Bucket
from ..executor.base import Executor
from ..request.buckets import bucket_name, default_bucket, largest_bucket
from .budget import memory_budget
from .probe_size import MIN_GROWTH, growth, probe_note, probe_plan, scale_peaks
from .requests import _device_of, _dummy_requests, _no_prompt_cache, _release

GIB = 1024**3


# --- memory -------------------------------------------------------------------------------------------------------
def measured_guidance(model) -> float | None:
    """The guidance scale memory is measured at (None: the model's default). Under classifier-free guidance a
    scale > 1 runs two denoiser rows per request: a model whose default is <= 1 still serves requests that ask for
    more, so it is measured at 2 (or its largest scale); otherwise the default already takes both rows."""
    if model.guidance != "cfg" or model.default_guidance_scale > 1 or model.max_guidance_scale <= 1:
        return None
    return min(2.0, float(model.max_guidance_scale))


def _run_once(executor: Executor, n: int, bucket: Bucket, tag: str) -> None:
    """One prepare + denoise + decode of `n` requests (at measured_guidance), then drop their tensors. Where the
    model caches steps the requests do (fbcache keeps the most per request), so its state counts in the peak;
    where it takes a negative prompt they carry one (Qwen-Image runs its unconditional row only with one)."""
    model = executor.model_info
    cache = "fbcache" if "fbcache" in model.cache_policies else "off"
    negative = "profile" if model.negative_prompt else ""
    requests = _dummy_requests(executor, n, bucket, measured_guidance(model), tag, cache=cache,
                               negative_prompt=negative)
    try:
        executor.prepare(requests)
        executor.denoise(requests)
        executor.decode(requests)
    finally:
        _release(requests)


# what torch's profiler writes to stderr from native code that is not news (see _without_profiler_notices)
PROFILER_NOTICES = ("USDT", "External init callback must run in same thread as registerClient")


@contextlib.contextmanager
def _without_profiler_notices() -> Iterator[None]:
    """torch's profiler prints 'USDT ... profiler_start/stop' notices from native code straight to file descriptor 2
    at every start and stop; a server's start-up log should not carry them. Nor the line its profiling library
    (kineto) prints when it first starts on a thread other than the one that imported torch, as in a Ray Serve
    replica: 'ERROR: External init callback must run in same thread as registerClient' (harmless: the profiler
    runs all the same). Native stderr goes to a temporary file meanwhile, and every other line is passed on."""
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
            kept = [line for line in sink.read().decode(errors="replace").splitlines(True)
                    if not any(notice in line for notice in PROFILER_NOTICES)]
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
    model's default size (and frames), with the model's default settings but a guidance scale that runs the most rows:
    measured_guidance), on top of what was allocated before (the weights).

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
    model = executor.model_info
    bucket = default_bucket(model) if bucket is None else tuple(bucket)
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


def format_bytes(nbytes: float) -> str:
    """1536 -> '1.5 KiB', in the largest binary unit that keeps the number >= 1."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


CAP_BATCH_SIZES = (1, 2, 4)  # measured by cap_max_batch_size (those <= the requested size); larger are extrapolated


def cap_max_batch_size(executor: Executor, requested_max: int, headroom: float = 0.2,
                       bucket: Bucket | None = None, share: float = 1.0,
                       reserve_bytes: Mapping[str, int] | int = 0) -> tuple[int, str]:
    """The configured max_batch_size, lowered if a batch that large would not fit in memory, with a one-line
    explanation. Never raises for a too-large request; when memory cannot be measured (the fake executor, an
    unsupported device) the request is kept and the explanation says why.

    The peak is measured (measure_peak_memory) at batch sizes 1, 2 and 4 (those up to `requested_max`) for
    `bucket` — default the largest size the model serves (with its most frames on a video model: a video request
    is charged as what it costs), since any batch may be of it; a bucket larger than probe_size.PROBE_PIXELS is
    measured at a smaller size of its aspect and scaled by the pixels (probe_size), so start-up takes seconds,
    not minutes — and extrapolated linearly in the batch size; the budget is memory_budget(), of which `headroom`
    is kept free. `share`: the fraction of that budget this engine may use, when engines share the device or host
    (Ray Serve replicas: EngineConfig.memory_share).
    `reserve_bytes`: kept out of the budget for what the engine holds beside its batches, by what it is (each
    add-on kind's memory: "LoRA adapters", "ControlNets", "IP-Adapters"; a bare number: "add-ons").
    """
    if not isinstance(requested_max, int) or isinstance(requested_max, bool) or requested_max < 1:
        raise ValueError(f"max_batch_size must be an integer >= 1, got {requested_max!r}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom!r}")
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share!r}")
    model = executor.model_info
    if bucket is None:
        bucket = largest_bucket(model)
    where = bucket_name(bucket)
    kind = _memory_kind(executor)
    if kind is None:
        return requested_max, (f"max_batch_size {requested_max} kept: {type(executor).__name__} has no torch "
                               f"device whose memory could be measured")
    sizes = [n for n in CAP_BATCH_SIZES if n <= requested_max]
    peaks: dict[int, int] = {}
    ran_out_at = None
    plan, started = probe_plan(model, bucket), time.monotonic()  # a small size stands for a large one (probe_size)
    k = MIN_GROWTH
    measuring = _iter_peaks(executor, sizes, plan.small)
    try:
        while True:
            try:
                n, peak = next(measuring)
            except StopIteration:
                break
            peaks[n] = peak
        smaller = None if plan.smaller is None else dict(_iter_peaks(executor, [1], plan.smaller)).get(1)
        k = growth(plan, peaks.get(1, 0), smaller)
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
    peaks = scale_peaks(plan, peaks, k)
    budget, what = memory_budget(executor)
    if share < 1:
        budget, what = int(budget * share), f"({share:.0%} share of {format_bytes(budget)} {what})"
    reserve = reserve_bytes if isinstance(reserve_bytes, Mapping) else {"add-ons": reserve_bytes}
    if sum(reserve.values()):  # kept for what the engine holds beside its batches, each add-on kind's memory named
        budget, what = max(budget - sum(reserve.values()), 0), f"{what}, less " + ", ".join(
            f"{format_bytes(n)} for {kind}" for kind, n in reserve.items() if n)
    if ran_out_at is not None:
        cap = max(ran_out_at - 1, 1)
        if peaks:
            cap = min(cap, memory_cap(peaks, budget, headroom))
        verdict = f"capped to {cap}" if cap < requested_max else "kept (it cannot go lower)"
        return cap, (f"max_batch_size {requested_max} {verdict}: a batch of {ran_out_at} ({bucket_name(plan.small)}) "
                     f"ran out of memory while measuring")
    cap = memory_cap(peaks, budget, headroom)
    biggest = max(peaks)
    detail = (f"{format_bytes(budget)} {what} with {headroom:.0%} headroom ({where}: "
              f"{format_bytes(peaks[biggest])} peak at batch {biggest}, "
              f"{probe_note(plan, k, time.monotonic() - started, bucket_name)})")
    if cap >= requested_max:
        return requested_max, f"max_batch_size {requested_max} kept: {requested_max} fits in {detail}"
    if _peak_at(sorted(peaks.items()), cap) > budget * (1 - headroom):
        return cap, f"max_batch_size {requested_max} capped to {cap}: not even {cap} fits in {detail}"
    return cap, f"max_batch_size {requested_max} capped to {cap}: {cap} fits in {detail}"
