"""The report's section on edits: latency of generations, image-to-image and inpainting requests apart."""

from __future__ import annotations

from .repeats import spread
from .report_format import fmt, table
from .results import BenchResults


def by_kind(results: BenchResults) -> list[str]:
    """Generations, edits and controlled requests apart, when the run has more than generations: p50 / p95, the
    median over repeats."""
    kinds = list(dict.fromkeys(k.kind for run in results.runs for k in run.latency_by_kind))
    if not kinds:
        return []
    rows = []
    for name in dict.fromkeys(run.contender for run in results.runs):
        runs = [r for r in results.runs if r.contender == name]
        cells = []
        for kind in kinds:
            stats = [k.latency for r in runs for k in r.latency_by_kind if k.kind == kind]
            p50, p95 = (spread([getattr(x, q) for x in stats]).median for q in ("p50", "p95"))
            done = sum(k.completed for r in runs for k in r.latency_by_kind if k.kind == kind)
            total = sum(k.measured for r in runs for k in r.latency_by_kind if k.kind == kind)
            cells.append(f"{fmt(p50, 'time')} / {fmt(p95, 'time')} ({done}/{total})")
        rows.append([name] + cells)
    header = ["contender"] + [{"image": "image to image"}.get(k, k) for k in kinds]
    return (["## Latency by kind (p50 / p95, median over repeats; completed/measured, all repeats)", ""]
            + table(header, rows))
