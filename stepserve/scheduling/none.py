"""No batching: one request at a time, start to finish."""

from __future__ import annotations

from .base import RequestLevelPolicy
from ..request.types import Request


class NoBatchingPolicy(RequestLevelPolicy):
    name = "none"

    def __init__(self) -> None:
        self.max_batch_size = 1

    def ready(self, candidates: list[Request], now: float, draining: bool) -> bool:
        return bool(candidates)
