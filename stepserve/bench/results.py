"""The plain records a benchmark produces, and results.json (every number, plus how it was produced)."""

from __future__ import annotations

import enum
import json
import math
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from .metrics import RunMetrics, StatusCounts
from .repeats import ContenderSummary
from .resources import Environment
from .targets import Contender

SCHEMA = "stepserve-bench/1"
SIMULATED = "simulated"  # Environment.device of results the simulator produced (`stepserve simulate`)


@dataclass
class BenchSettings:
    """Everything that shaped the run (the flags, resolved)."""

    target: str  # "in-process <model>" or the URL(s)
    model: str | None
    device: str
    dtype: str
    contenders: list[Contender]
    mix: dict[str, Any]
    load: str  # poisson | closed | trace
    rate_rps: float | None
    rate_frac: float | None
    users: int | None
    trace_file: str | None
    duration_s: float
    warmup_s: float
    drain_s: float
    repeats: int
    seed: int
    slo_rule: str
    sweep: bool
    sweep_rates_rps: list[float] = field(default_factory=list)
    timeout_s: float | None = None  # every request's deadline (SamplingParams / body "timeout_s"); None: none
    timeout_rule: str | None = None  # how it was set: "--timeout-s", or "--timeout-slo: the run's SLO"
    own_slo_requests: int = 0  # trace requests with their own slo_ms: their SLO and deadline (the run's don't apply)
    latency_model: str | None = None  # slo contenders: where their latency model came from
    backend: str = "torch"  # in-process: how the networks ran (torch | onnxruntime | tensorrt)
    # --peers: per contender {"name", "peer", "versions", "config"} (bench/peers/registry.py record)
    peers: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Startup:
    model_load_s: float | None  # loading the model (in-process); None for an external server
    engine_start_s: list[float] = field(default_factory=list)  # per contender run: building and starting the engine
    latency_model_s: float | None = None  # measuring the slo contenders' latency model once (None: not measured)


@dataclass
class IdleLatency:
    steps: int | None
    latency_s: float  # median of `samples` lone requests (the mix's costliest settings at this step count)
    samples: int


@dataclass
class Capacity:
    contender: str
    rps: float  # completions per second, saturated (closed loop, `users` users)
    users: int
    duration_s: float
    completed: int


@dataclass
class SweepPoint:
    contender: str
    rate_rps: float  # the nominal Poisson rate; every contender gets the same trace at it
    offered_rps: float  # the rate the trace actually realised inside the measured window
    counts: StatusCounts
    p50_s: float | None
    p95_s: float | None  # completed requests only
    p95_all_s: float | None  # non-completed counted as infinitely late (None = infinite)
    throughput_rps: float
    goodput_rps: float | None
    slo_attainment: float | None
    held: bool  # p95_all_s <= SLO


@dataclass
class Knee:
    contender: str
    rate_rps: float | None  # highest nominal rate whose p95 (all requests) held the SLO; None: not even the lowest
    offered_rps: float | None  # the realised rate of that point
    highest_tested_rps: float
    held_at_top: bool  # the knee may lie above the grid


@dataclass
class CdfSeries:
    contender: str
    latencies_s: list[float]  # sorted, completed measured requests of every repeat


@dataclass
class BatchTimeline:
    contender: str
    t_s: list[float]  # when each engine step started, seconds after the start of the run
    batch_size: list[int]  # requests in the step's denoising forward (0: none, e.g. a decode-only step)
    duration_s: list[float]  # how long each step ran; a longer wait before the next step is the engine idle


@dataclass
class BenchResults:
    environment: Environment
    settings: BenchSettings
    startup: Startup
    load_description: str
    slo_s: float | None
    warmup_note: str
    idle: list[IdleLatency] = field(default_factory=list)
    capacity: Capacity | None = None
    runs: list[RunMetrics] = field(default_factory=list)
    summaries: list[ContenderSummary] = field(default_factory=list)
    cdf: list[CdfSeries] = field(default_factory=list)
    timelines: list[BatchTimeline] = field(default_factory=list)
    sweep: list[SweepPoint] = field(default_factory=list)
    knees: list[Knee] = field(default_factory=list)
    conclusions: list[str] = field(default_factory=list)
    schema: str = SCHEMA
    clock: str = "wall"  # "simulated" when every engine ran on a simulated clock (stepserve simulate)

    def __post_init__(self) -> None:
        if self.environment.device == "simulated":
            self.clock = "simulated"

    @property
    def simulated(self) -> bool:
        """Whether these numbers come from the simulator (a latency model on a simulated clock), not a device."""
        return self.environment.device == SIMULATED


def to_jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return {k: to_jsonable(v) for k, v in asdict(value).items()}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(results: BenchResults, path: Path) -> None:
    path.write_text(json.dumps(to_jsonable(results), indent=1, allow_nan=False) + "\n")
