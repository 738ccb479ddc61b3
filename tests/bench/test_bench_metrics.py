"""Percentiles, SLO attainment, goodput and throughput on hand-made samples."""

import pytest

from stepserve.bench.load import LoadResult, Outcome
from stepserve.bench.metrics import (Usage, busy_in_window, latency_stats, p95_all, percentile, slo_attainment,
                                     summarize, window_rates)
from stepserve.bench.repeats import summarize_repeats
from stepserve.bench.targets import FAILED, OK, REJECTED, UNFINISHED, Reply, StepSample
from stepserve.bench.workload import RequestSpec


def outcome(i, scheduled, latency=None, status=OK, steps=20, warmup=False, **reply):
    done = None if latency is None else scheduled + latency
    return Outcome(i, RequestSpec("p", i, num_inference_steps=steps), scheduled, sent_s=scheduled, done_s=done,
                   warmup=warmup, reply=Reply(status, **reply))


def test_nearest_rank_percentiles():
    values = [float(v) for v in range(100, 0, -1)]  # order must not matter
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0], 50) == 3.0
    assert percentile([1.0, 2.0], 50) == 1.0  # the smallest sample with at least half at or below it
    stats = latency_stats([1.0, 2.0, 3.0, 10.0])
    assert (stats.count, stats.p50, stats.p95, stats.max, stats.mean) == (4, 2.0, 10.0, 10.0, 4.0)
    assert latency_stats([]).count == 0 and latency_stats([]).p50 is None
    with pytest.raises(ValueError):
        percentile([], 50)


def test_slo_attainment_counts_rejected_and_unfinished_in_the_denominator():
    outs = [outcome(0, 0.0, 0.5), outcome(1, 0.1, 0.9), outcome(2, 0.2, 2.0),  # 2 of 3 completed within 1 s
            outcome(3, 0.3, status=REJECTED), outcome(4, 0.4, status=UNFINISHED), outcome(5, 0.5, status=FAILED)]
    assert slo_attainment(outs, 1.0) == pytest.approx(2 / 6)
    assert slo_attainment(outs[:3], 1.0) == pytest.approx(2 / 3)
    assert slo_attainment([], 1.0) is None


def test_p95_all_treats_non_completed_as_infinitely_late():
    ok = [outcome(i, 0.0, 1.0) for i in range(19)]
    assert p95_all(ok + [outcome(19, 0.0, status=REJECTED)]) == 1.0  # 1 in 20 missing: p95 still a real sample
    assert p95_all(ok[:18] + [outcome(18, 0.0, status=REJECTED), outcome(19, 0.0, status=UNFINISHED)]) is None


def test_throughput_and_goodput_over_the_measured_window():
    # window [1, 3]; completions at 0.5 (before), 1.5, 2.0, 2.9, 3.5 (after); SLO 1 s
    outs = [outcome(0, 0.0, 0.5, warmup=True), outcome(1, 1.0, 0.5), outcome(2, 0.5, 1.5), outcome(3, 2.5, 0.4),
            outcome(4, 3.0, 0.5), outcome(5, 1.2, status=REJECTED)]
    result = LoadResult(outs, start=100.0, window_start_s=1.0, window_end_s=3.0, mode="open-loop", description="t")
    rates = window_rates(result, 1.0)
    assert rates.throughput_rps == pytest.approx(3 / 2.0)  # 1.5, 2.0, 2.9
    assert rates.goodput_rps == pytest.approx(2 / 2.0)  # 2.0 took 1.5 s: over the SLO


def test_summarize_counts_parts_busy_and_batches():
    outs = [outcome(0, 0.0, 0.5, warmup=True),
            outcome(1, 1.0, 0.4, queue_s=0.1, denoise_s=0.25, decode_s=0.05, batch_sizes=[2, 2]),
            outcome(2, 1.5, 0.6, steps=40, queue_s=0.2, denoise_s=0.35, decode_s=0.05),
            outcome(3, 2.0, status=REJECTED), outcome(4, 2.5, status=UNFINISHED)]
    result = LoadResult(outs, start=100.0, window_start_s=1.0, window_end_s=3.0, mode="open-loop", description="t")
    samples = [StepSample(100.5, 1.0, 1), StepSample(101.5, 0.5, 2), StepSample(102.2, 0.2, 4),
               StepSample(102.9, 0.5, 4)]  # overlap with [101, 103]: 0.5 + 0.5 + 0.2 + 0.1
    m = summarize(result, "c", 0, 1.0, samples, None, 3.0, Usage())
    assert (m.counts.offered, m.counts.completed, m.counts.rejected, m.counts.unfinished) == (4, 2, 1, 1)
    assert m.latency.count == 2 and m.latency.max == pytest.approx(0.6)
    assert m.slo_attainment == pytest.approx(2 / 4)
    assert m.busy_fraction == pytest.approx(1.3 / 2.0)
    assert busy_in_window(samples, 101.0, 103.0) == pytest.approx(1.3)
    assert [(b.size, b.count) for b in m.batch_sizes] == [(2, 1), (4, 2)]  # steps that started in the window
    assert m.mean_batch_size == pytest.approx(10 / 3)
    assert m.queue.p50 == pytest.approx(0.1) and m.denoise.max == pytest.approx(0.35)
    assert [b.steps for b in m.latency_by_steps] == [20, 40]
    assert m.latencies_s == sorted(m.latencies_s)


def test_summarize_repeats_reports_median_and_spread():
    runs = []
    for i, lat in enumerate((1.0, 3.0, 2.0)):
        outs = [outcome(0, 1.0, lat)]
        result = LoadResult(outs, 0.0, 0.0, 10.0, "open-loop", "t")
        runs.append(summarize(result, "c", i, 5.0, [], None, 10.0, Usage()))
    s = summarize_repeats(runs)
    assert (s.p50_s.median, s.p50_s.low, s.p50_s.high) == (2.0, 1.0, 3.0)
    assert s.repeats == 3 and s.offered == 3
