"""One contender's runs summarised across repeats: each metric's median and range (Spread), counts summed."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .metrics import RunMetrics


@dataclass
class Spread:
    median: float | None
    low: float | None
    high: float | None


def spread(values: list[float | None]) -> Spread:
    present = [v for v in values if v is not None]
    if not present:
        return Spread(None, None, None)
    return Spread(statistics.median(present), min(present), max(present))


@dataclass
class ContenderSummary:
    contender: str
    repeats: int
    offered: int  # summed over repeats
    completed: int
    rejected: int
    failed: int
    unfinished: int
    p50_s: Spread
    p95_s: Spread
    p99_s: Spread
    max_s: Spread
    throughput_rps: Spread
    goodput_rps: Spread
    slo_attainment: Spread
    busy_fraction: Spread
    mean_batch_size: Spread
    cpu_util: Spread
    queue_p50_s: Spread
    denoise_p50_s: Spread
    decode_p50_s: Spread
    deadline_missed: int = 0  # summed over repeats
    late_ok: int = 0  # summed over repeats
    refusal_p50_ms: Spread = field(default_factory=lambda: Spread(None, None, None))
    refusal_p99_ms: Spread = field(default_factory=lambda: Spread(None, None, None))
    refusal_max_ms: Spread = field(default_factory=lambda: Spread(None, None, None))
    goodput_frac: Spread = field(default_factory=lambda: Spread(None, None, None))  # goodput / measured capacity
    # bench --quality: images that used step caching, and their mean PSNR (dB) / SSIM against uncached ones
    cached_images: int = 0
    psnr_db: float | None = None
    ssim: float | None = None
    cached_step_frac: Spread = field(default_factory=lambda: Spread(None, None, None))  # steps that reused cache


def summarize_repeats(runs: list[RunMetrics], capacity_rps: float | None = None) -> ContenderSummary:
    """The runs of one contender; `capacity_rps` (when measured) gives goodput_frac = goodput / capacity."""

    def over(fn) -> Spread:
        return spread([fn(r) for r in runs])

    def frac(r: RunMetrics) -> float | None:
        return None if r.goodput_rps is None or not capacity_rps else r.goodput_rps / capacity_rps

    return ContenderSummary(
        contender=runs[0].contender, repeats=len(runs),
        offered=sum(r.counts.offered for r in runs), completed=sum(r.counts.completed for r in runs),
        rejected=sum(r.counts.rejected for r in runs), failed=sum(r.counts.failed for r in runs),
        unfinished=sum(r.counts.unfinished for r in runs),
        p50_s=over(lambda r: r.latency.p50), p95_s=over(lambda r: r.latency.p95), p99_s=over(lambda r: r.latency.p99),
        max_s=over(lambda r: r.latency.max), throughput_rps=over(lambda r: r.throughput_rps),
        goodput_rps=over(lambda r: r.goodput_rps), slo_attainment=over(lambda r: r.slo_attainment),
        busy_fraction=over(lambda r: r.busy_fraction), mean_batch_size=over(lambda r: r.mean_batch_size),
        cpu_util=over(lambda r: r.usage.cpu_util), queue_p50_s=over(lambda r: r.queue.p50),
        denoise_p50_s=over(lambda r: r.denoise.p50), decode_p50_s=over(lambda r: r.decode.p50),
        deadline_missed=sum(r.counts.deadline_missed for r in runs), late_ok=sum(r.late_ok for r in runs),
        refusal_p50_ms=over(lambda r: r.refusal.p50_ms), refusal_p99_ms=over(lambda r: r.refusal.p99_ms),
        refusal_max_ms=over(lambda r: r.refusal.max_ms), goodput_frac=over(frac),
        cached_step_frac=over(lambda r: r.cached_step_frac),
    )
