"""Batching policies: one module each, none of them reads the clock."""

from __future__ import annotations

from .base import Policy
from .continuous import ContinuousBatchingPolicy
from .dynamic import DynamicBatchingPolicy
from .none import NoBatchingPolicy
from .static import DEFAULT_FLUSH_TIMEOUT_S, StaticBatchingPolicy

STRATEGIES = ("continuous", "dynamic", "static", "none")
DEFAULT_MAX_QUEUE_DELAY_MS = 50.0


def make_policy(
    strategy: str,
    max_batch_size: int = 8,
    max_queue_delay_ms: float = DEFAULT_MAX_QUEUE_DELAY_MS,
    static_batch_size: int | None = None,
    static_flush_timeout_s: float | None = DEFAULT_FLUSH_TIMEOUT_S,
) -> Policy:
    """Build a policy by name; a bad name or setting raises ValueError naming what is allowed."""
    if strategy == "continuous":
        return ContinuousBatchingPolicy(max_batch_size)
    if strategy == "dynamic":
        return DynamicBatchingPolicy(max_batch_size, max_queue_delay_ms / 1000.0)
    if strategy == "static":
        return StaticBatchingPolicy(static_batch_size or max_batch_size, static_flush_timeout_s)
    if strategy == "none":
        return NoBatchingPolicy()
    raise ValueError(f"strategy: {strategy!r} is not supported; allowed: {', '.join(STRATEGIES)}")


__all__ = [
    "STRATEGIES",
    "Policy",
    "ContinuousBatchingPolicy",
    "DynamicBatchingPolicy",
    "NoBatchingPolicy",
    "StaticBatchingPolicy",
    "make_policy",
]
