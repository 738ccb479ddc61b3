"""The numbers of one run, from what the load generator saw and what the engine reported.

Percentiles use the nearest-rank method (the smallest sample with at least q of the samples at or below it), so
every reported value is a latency that some request actually had. Rejected, failed, timed-out and unfinished
requests stay in the denominators of SLO attainment and are counted in every table.

With deadlines (requests carrying timeout_s): a request the target gave up on at its deadline is a deadline miss,
counted apart from other failures; an OK answer that came back more than timeout_s after the request was sent is
`late_ok` (an engine that honours deadlines has none); and how quickly refusals were told is the time from each
rejected request's actual send to its rejection reply (the sender's own lag behind the schedule is reported
separately, as send_lag, and not blamed on the target).

Per-request SLOs: a request that carries its own SLO (RequestSpec.slo_ms, from a trace) is judged against it for
SLO attainment and goodput; the others against the run's SLO. Without a run SLO, only requests with their own
count.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from .load import LoadResult, Outcome
from .targets import FAILED, OK, REJECTED, TIMEOUT, UNFINISHED, StepSample


@dataclass
class LatencyStats:
    count: int
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    max: float | None = None
    mean: float | None = None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile, q in (0, 100]."""
    if not values:
        raise ValueError("percentile of no samples")
    if not 0 < q <= 100:
        raise ValueError(f"q must be in (0, 100], got {q}")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def latency_stats(values: list[float]) -> LatencyStats:
    if not values:
        return LatencyStats(0)
    return LatencyStats(len(values), percentile(values, 50), percentile(values, 95), percentile(values, 99),
                        max(values), statistics.fmean(values))


@dataclass
class StatusCounts:
    offered: int  # measured requests (warm-up excluded)
    completed: int
    rejected: int
    failed: int  # failures other than deadline misses
    unfinished: int  # still out when the drain time ran out (cancelled)
    deadline_missed: int = 0  # failed with a timeout: the target gave up at the request's deadline


@dataclass
class RefusalTiming:
    """How quickly rejected requests were told: actual send -> rejection reply, in milliseconds."""

    count: int
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None


def refusal_timing(outcomes: list[Outcome]) -> RefusalTiming:
    waits = [1000.0 * (o.done_s - (o.scheduled_s if o.sent_s is None else o.sent_s)) for o in outcomes
             if o.status == REJECTED and o.done_s is not None]
    if not waits:
        return RefusalTiming(0)
    return RefusalTiming(len(waits), percentile(waits, 50), percentile(waits, 99), max(waits))


@dataclass
class LateAnswers:
    """OK answers that came back after the request's deadline (from its actual send, so the sender's own lag is
    not blamed on the target)."""

    count: int
    max_over_ms: float | None = None  # how far past its deadline the latest one came back


def late_answers(outcomes: list[Outcome]) -> LateAnswers:
    over = [1000.0 * (o.done_s - o.sent_s - o.spec.timeout_s) for o in outcomes
            if o.status == OK and o.spec.timeout_s is not None and o.done_s is not None and o.sent_s is not None]
    late = [v for v in over if v > 0]
    return LateAnswers(len(late), max(late) if late else None)


@dataclass
class BatchCount:
    size: int
    count: int


@dataclass
class StepsLatency:
    steps: int | None
    latency: LatencyStats


@dataclass
class KindLatency:
    kind: str  # "generation", "image" (image to image) or "inpaint" (bench/edits.py)
    measured: int  # measured requests of this kind
    completed: int
    latency: LatencyStats  # of the completed ones


@dataclass
class Usage:
    cpu_util: float | None = None  # process CPU time / (wall time x cores)
    cpu_cores_used: float | None = None  # process CPU time / wall time
    gpu_util: float | None = None  # NVML utilisation, mean over the run (0-1)
    gpu_mem_mib: float | None = None  # NVML memory used, max over the run


@dataclass
class RunMetrics:
    contender: str
    repeat: int
    load: str
    mode: str
    window_s: float
    counts: StatusCounts
    latency: LatencyStats  # completed measured requests, from scheduled send to answer
    latency_by_steps: list[StepsLatency]
    p95_all_s: float | None  # p95 with non-completed requests counted as infinitely late; None = infinite
    queue: LatencyStats
    first_step: LatencyStats
    denoise: LatencyStats
    decode: LatencyStats
    send_lag: LatencyStats  # actual send - scheduled send (open loop); the sender's own accuracy
    offered_rps: float  # measured requests sent / window (the realised rate, not the nominal one)
    throughput_rps: float  # completions inside the measured window / window
    goodput_rps: float | None  # completions inside the window that met the SLO / window
    slo_s: float | None
    slo_attainment: float | None  # measured requests that completed within their SLO / all measured requests
    busy_fraction: float | None  # time inside executor steps / wall time
    batch_sizes: list[BatchCount] = field(default_factory=list)
    batch_size_source: str = ""
    mean_batch_size: float | None = None
    usage: Usage = field(default_factory=Usage)
    latencies_s: list[float] = field(default_factory=list)  # sorted, for the CDF
    refusal: RefusalTiming = field(default_factory=lambda: RefusalTiming(0))  # rejected: actual send -> reply
    rejected_reasons: dict[str, int] = field(default_factory=dict)  # e.g. queue_full, deadline_infeasible
    late_ok: int = 0  # OK answers that came back after their deadline (must be 0 for an engine honouring them)
    cached_step_frac: float | None = None  # completed requests' steps that reused cached work / all their steps
    late_ok_max_over_ms: float | None = None
    own_slo: int = 0  # measured requests judged against their own SLO (slo_ms) rather than the run's
    latency_by_kind: list[KindLatency] = field(default_factory=list)  # when the run has edits: per kind
    fleet: Any = None  # a simulated fleet's run: replicas, router, replica-seconds, load over time (sim.fleet_run)


def rejection_reasons(outcomes: list[Outcome]) -> dict[str, int]:
    c = Counter(o.reply.reason or "unspecified" for o in outcomes if o.status == REJECTED)
    return dict(sorted(c.items()))


def count_statuses(outcomes: list[Outcome]) -> StatusCounts:
    c = Counter(o.status for o in outcomes)
    return StatusCounts(len(outcomes), c[OK], c[REJECTED], c[FAILED], c[UNFINISHED], c[TIMEOUT])


def slo_of(o: Outcome, slo_s: float | None) -> float | None:
    """The SLO `o` is judged against, in seconds: its own (slo_ms) when it has one, else the run's."""
    return slo_s if o.spec.slo_ms is None else o.spec.slo_ms / 1000.0


def within_slo(o: Outcome, slo_s: float | None) -> bool:
    slo = slo_of(o, slo_s)
    return slo is not None and o.latency_s is not None and o.latency_s <= slo


def slo_attainment(outcomes: list[Outcome], slo_s: float | None) -> float | None:
    """Share of requests answered within their SLO (their own, else the run's `slo_s`); every non-completed
    request counts as a miss. Requests with no SLO at all are left out; None when none has one."""
    judged = [o for o in outcomes if slo_of(o, slo_s) is not None]
    if not judged:
        return None
    return sum(1 for o in judged if within_slo(o, slo_s)) / len(judged)


def p95_all(outcomes: list[Outcome]) -> float | None:
    """p95 over every measured request, non-completed ones as infinitely late (None when that is the p95)."""
    if not outcomes:
        return None
    values = [math.inf if o.latency_s is None else o.latency_s for o in outcomes]
    value = percentile(values, 95)
    return None if math.isinf(value) else value


@dataclass
class WindowRates:
    throughput_rps: float  # completions inside the measured window, per second
    goodput_rps: float | None  # of those, the ones within the SLO, per second


def window_rates(result: LoadResult, slo_s: float | None) -> WindowRates:
    lo, hi = result.window_start_s, result.window_end_s
    span = hi - lo
    if span <= 0:
        return WindowRates(0.0, None)
    done = [o for o in result.outcomes if o.status == OK and o.done_s is not None and lo <= o.done_s <= hi]
    judged = slo_s is not None or any(o.spec.slo_ms is not None for o in result.outcomes)
    good = sum(1 for o in done if within_slo(o, slo_s)) / span if judged else None
    return WindowRates(len(done) / span, good)


def busy_in_window(samples: list[StepSample], start: float, end: float) -> float:
    """Seconds inside executor steps that overlap [start, end] (monotonic times)."""
    return sum(max(0.0, min(s.t + s.duration_s, end) - max(s.t, start)) for s in samples)


def batch_histogram(sizes: list[int]) -> list[BatchCount]:
    return [BatchCount(size, n) for size, n in sorted(Counter(s for s in sizes if s > 0).items())]


def summarize(result: LoadResult, contender: str, repeat: int, slo_s: float | None,
              samples: list[StepSample], busy_delta_s: float | None, wall_s: float, usage: Usage) -> RunMetrics:
    measured = result.measured
    done = [o for o in measured if o.status == OK]
    latencies = sorted(o.latency_s for o in done)
    by_steps = sorted({o.spec.num_inference_steps for o in measured}, key=lambda s: (s is None, s or 0))
    rates = window_rates(result, slo_s)
    w0, w1 = result.start + result.window_start_s, result.start + result.window_end_s
    if samples:
        busy = busy_in_window(samples, w0, w1) / (w1 - w0) if w1 > w0 else None
        sizes = [s.batch_size for s in samples if w0 <= s.t <= w1]
        source = "engine forward passes in the window"
    else:
        busy = None if busy_delta_s is None or wall_s <= 0 else busy_delta_s / wall_s
        sizes = [b for o in done for b in o.reply.batch_sizes]
        source = "per request-step, from the server's timing field"
    hist = batch_histogram(sizes)
    total = sum(b.count for b in hist)
    late = late_answers(measured)
    return RunMetrics(
        contender=contender, repeat=repeat, load=result.description, mode=result.mode,
        window_s=result.window_end_s - result.window_start_s, counts=count_statuses(measured),
        latency=latency_stats(latencies),
        latency_by_steps=[StepsLatency(s, latency_stats([o.latency_s for o in done if o.spec.num_inference_steps == s]))
                          for s in by_steps],
        p95_all_s=p95_all(measured),
        queue=_part(done, "queue_s"), first_step=_part(done, "first_step_s"), denoise=_part(done, "denoise_s"),
        decode=_part(done, "decode_s"),
        send_lag=latency_stats([o.sent_s - o.scheduled_s for o in measured if o.sent_s is not None]),
        offered_rps=len(measured) / (w1 - w0) if w1 > w0 else 0.0, throughput_rps=rates.throughput_rps,
        goodput_rps=rates.goodput_rps, slo_s=slo_s,
        slo_attainment=slo_attainment(measured, slo_s),
        busy_fraction=busy, batch_sizes=hist, batch_size_source=source,
        mean_batch_size=sum(b.size * b.count for b in hist) / total if total else None,
        usage=usage, latencies_s=latencies, refusal=refusal_timing(measured),
        rejected_reasons=rejection_reasons(measured), late_ok=late.count, late_ok_max_over_ms=late.max_over_ms,
        own_slo=sum(1 for o in measured if o.spec.slo_ms is not None),
        cached_step_frac=_cached_frac(done), latency_by_kind=_by_kind(measured),
    )


def _by_kind(measured: list[Outcome]) -> list[KindLatency]:
    """Latency per kind of request (generations, image to image, inpainting, with a ControlNet), when the run has
    more than generations."""
    from .edits import KINDS, kind_of

    kinds = {kind_of(o.spec) for o in measured}
    if kinds <= {"generation"}:
        return []
    out = []
    for kind in (k for k in KINDS if k in kinds):
        mine = [o for o in measured if kind_of(o.spec) == kind]
        done = [o.latency_s for o in mine if o.status == OK]
        out.append(KindLatency(kind, len(mine), len(done), latency_stats(done)))
    return out


def _cached_frac(done: list) -> float | None:
    steps = sum(len(o.reply.batch_sizes) for o in done)
    return sum(o.reply.cached_steps for o in done) / steps if steps else None


def _part(done: list[Outcome], name: str) -> LatencyStats:
    return latency_stats([getattr(o.reply, name) for o in done if getattr(o.reply, name) is not None])
