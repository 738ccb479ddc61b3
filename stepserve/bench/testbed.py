"""What a benchmark runs against: the targets of the contenders and of the reference, the driver (the clock)
they run on, and how the results describe them. bench.live_bed builds the live one; stepserve.sim.bench the
simulated one; run_bench takes either."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .results import Startup
from .runner import Driver, TargetMaker


@dataclass
class Described:
    """What the results say the load ran against (results.json's settings)."""

    target: str
    model: str | None
    device: str
    dtype: str
    backend: str
    peers: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Makers:
    contenders: list[TargetMaker]  # one per contender
    reference: TargetMaker  # for idle latency and capacity: continuous in process, else the first server
    latency_model: Any = None  # the LatencyModel every slo contender got (in process; simulated: every engine)
    latency_model_source: str | None = None
    uncached: Any = None  # in process: specs -> their images without step caching (bench --quality)


@dataclass
class Testbed:
    driver: Driver
    makers: Makers
    environment: str  # the device capture_environment records ("cpu", "http", "simulated", ...)
    described: Described
    startup: Startup
