"""The report's sections about what each run did: how quickly refusals were told, latency by step count, and the
batch sizes run."""

from __future__ import annotations

from .repeats import Spread
from .report_format import fmt, ms, table as _table
from .results import BenchResults


def refusals(results: BenchResults) -> list[str]:
    """How quickly each contender told the requests it refused (only when something was refused)."""
    if not any(s.rejected for s in results.summaries):
        return []
    reps = results.settings.repeats
    reasons: dict[str, dict[str, int]] = {}
    for run in results.runs:
        mine = reasons.setdefault(run.contender, {})
        for why, n in run.rejected_reasons.items():
            mine[why] = mine.get(why, 0) + n
    over = " (median over repeats [min-max])" if reps > 1 else ""
    rows = [[s.contender, str(s.rejected),
             ", ".join(f"{why} {n}" for why, n in reasons.get(s.contender, {}).items()) or "-",
             _ms_spread(s.refusal_p50_ms, reps), _ms_spread(s.refusal_p99_ms, reps),
             _ms_spread(s.refusal_max_ms, reps)] for s in results.summaries]
    return ([f"## Refusals: how quickly they were told, from the actual send to the rejection{over}", ""]
            + _table(["contender", "rejected", "why", "p50", "p99", "max"], rows))


def _ms_spread(s: Spread, repeats: int) -> str:
    if s.median is None:
        return "n/a"
    if repeats < 2:
        return ms(s.median)
    return f"{ms(s.median)} [{ms(s.low)}-{ms(s.high)}]"


def by_steps(results: BenchResults) -> list[str]:
    first = {}
    for run in results.runs:
        first.setdefault(run.contender, run)
    steps = sorted({b.steps for run in first.values() for b in run.latency_by_steps if b.steps is not None})
    if len(steps) < 2:
        return []
    rows = []
    for name, run in first.items():
        cells = {b.steps: b.latency for b in run.latency_by_steps}
        rows.append([name] + [f"{fmt(cells[s].p50, 'time')} / {fmt(cells[s].p95, 'time')}" if s in cells else "n/a"
                              for s in steps])
    header = ["contender"] + [f"{s} steps" for s in steps]
    return ["## Latency by step count (p50 / p95, first repeat)", ""] + _table(header, rows)


def batches(results: BenchResults) -> list[str]:
    first = {}
    for run in results.runs:
        first.setdefault(run.contender, run)
    sizes = sorted({b.size for run in first.values() for b in run.batch_sizes})
    if not sizes:
        return []
    rows = []
    for name, run in first.items():
        total = sum(b.count for b in run.batch_sizes) or 1
        counts = {b.size: b.count for b in run.batch_sizes}
        rows.append([name] + [f"{100 * counts.get(s, 0) / total:.0f}%" for s in sizes])
    source = next(iter(first.values())).batch_size_source
    header = ["contender"] + [str(s) for s in sizes]
    return [f"## Batch sizes run (share of {source}, first repeat)", ""] + _table(header, rows)
