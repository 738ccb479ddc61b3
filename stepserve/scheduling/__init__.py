"""Batching policies: one module each, none of them reads the clock."""

from __future__ import annotations

from ..costs.latency_model import LatencyModel
from .adaptive import AdaptiveBatchingPolicy
from .base import Policy
from .continuous import ContinuousBatchingPolicy
from .dynamic import DynamicBatchingPolicy
from .none import NoBatchingPolicy
from .slo import ORDERS as SLO_ORDERS
from .slo import SLOPolicy
from .static import DEFAULT_FLUSH_TIMEOUT_S, StaticBatchingPolicy

STRATEGIES = ("continuous", "dynamic", "static", "none", "slo", "adaptive")
# The default: deadline-aware and cost-aware (docs/BENCHMARKS.md, "Regime matrix": within the margins of the best
# contender in every simulated regime, load and deadline setting).
DEFAULT_STRATEGY = "slo"
DEFAULT_MAX_QUEUE_DELAY_MS = 50.0


def make_policy(
    strategy: str,
    max_batch_size: int = 8,
    max_queue_delay_ms: float = DEFAULT_MAX_QUEUE_DELAY_MS,
    static_batch_size: int | None = None,
    static_flush_timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S,
    latency_model: LatencyModel | None = None,
    slo_order: str = "srs",
) -> Policy:
    """Build a policy by name; a bad name or setting raises ValueError naming what is allowed.

    `latency_model` is what "slo" predicts with, and the prior of "adaptive"'s step curve (the other strategies
    ignore it). Without one, "slo" uses
    LatencyModel.zero(): it keeps its ordering rules (priority, deadlines, fair buckets) but predicts no misses,
    so it refuses nothing and gives up on nothing before the deadline itself passes. `slo_order` is its order
    within a priority class: "edf" (earliest deadline first) or "srs" (shortest remaining steps first).
    """
    if strategy == "continuous":
        return ContinuousBatchingPolicy(max_batch_size)
    if strategy == "dynamic":
        return DynamicBatchingPolicy(max_batch_size, max_queue_delay_ms / 1000.0)
    if strategy == "static":
        return StaticBatchingPolicy(static_batch_size or max_batch_size, static_flush_timeout_s)
    if strategy == "none":
        return NoBatchingPolicy()
    if strategy == "slo":
        return SLOPolicy(max_batch_size, latency_model if latency_model is not None else LatencyModel.zero(),
                         order=slo_order)
    if strategy == "adaptive":
        return AdaptiveBatchingPolicy(max_batch_size, latency_model)
    raise ValueError(f"strategy: {strategy!r} is not supported; allowed: {', '.join(STRATEGIES)}")


__all__ = [
    "AdaptiveBatchingPolicy",
    "SLO_ORDERS",
    "STRATEGIES",
    "DEFAULT_STRATEGY",
    "Policy",
    "ContinuousBatchingPolicy",
    "DynamicBatchingPolicy",
    "NoBatchingPolicy",
    "SLOPolicy",
    "StaticBatchingPolicy",
    "make_policy",
]
