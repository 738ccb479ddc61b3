"""A discrete distribution of one request field in a workload mix (bench/workload.py): values with weights."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass
class Choice:
    """A discrete distribution: values with (unnormalised) weights."""

    values: list[Any]
    weights: list[float]

    @classmethod
    def of(cls, spec: Any, name: str) -> "Choice":
        if isinstance(spec, dict):
            if not spec:
                raise ValueError(f"mix field {name!r}: the mapping is empty")
            values, weights = list(spec.keys()), [float(w) for w in spec.values()]
        elif isinstance(spec, (list, tuple)):
            if not spec:
                raise ValueError(f"mix field {name!r}: the list is empty")
            values, weights = list(spec), [1.0] * len(spec)
        else:
            values, weights = [spec], [1.0]
        if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
            raise ValueError(f"mix field {name!r}: weights must be finite, >= 0 and not all 0")
        return cls(values, weights)

    def draw(self, rng: random.Random) -> Any:
        return rng.choices(self.values, weights=self.weights, k=1)[0]
