"""The throughput verdict of report.md: at a fixed rate below capacity, throughput echoes the offered load, so the
report says who kept pace with it (one rule, with its tolerance stated) instead of ranking them."""

from __future__ import annotations

from .report_format import fmt
from .results import BenchResults

KEEP_PACE_TOLERANCE = 0.10  # kept pace: throughput at least 90% of the rate that arrived in the measured window


def kept_pace(results: BenchResults, values: dict[str, float]) -> list[str]:
    """Contenders whose throughput came within KEEP_PACE_TOLERANCE of the realised rate: at a fixed rate below
    their capacity, throughput only echoes the offered load and does not rank them. One rule on the numbers the
    report shows, so each verdict can be checked against them."""
    offered = realised_rate(results)
    if not offered:
        return []
    return [name for name, value in values.items() if value >= (1 - KEEP_PACE_TOLERANCE) * offered]


def realised_rate(results: BenchResults) -> float | None:
    """The open-loop rate the trace realised in the measured window (identical for every contender)."""
    rates = [r.offered_rps for r in results.runs if r.mode == "open-loop"]
    return rates[0] if rates else None


def realised_text(results: BenchResults) -> str:
    """How the Load line and the throughput verdict both name the realised rate (one number, one wording)."""
    rate = realised_rate(results)
    return f"realised in the measured window: {rate:.2f} req/s" if rate else ""


def kept_pace_text(results: BenchResults, values: dict[str, float], kept: list[str]) -> str:
    offered = realised_rate(results)
    floor = (1 - KEEP_PACE_TOLERANCE) * offered
    text = (f"**throughput**: {', '.join(kept)} kept pace with the load ({realised_text(results)}; kept pace = "
            f"throughput at least {1 - KEEP_PACE_TOLERANCE:.0%} of it, {floor:.2f}/s): "
            f"{fmt(min(values[k] for k in kept), 'rate')} to {fmt(max(values[k] for k in kept), 'rate')}; "
            "at this rate throughput does not rank them, the knee of a sweep does")
    behind = [k for k in values if k not in kept]
    if behind:
        text += "; fell behind: " + ", ".join(f"{k} {fmt(values[k], 'rate')}" for k in behind)
    return text + "."
