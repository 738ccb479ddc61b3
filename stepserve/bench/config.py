"""What a benchmark run is asked to do: the one configuration `stepserve bench`, the demo and the simulator fill in."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .targets import Contender
from .workload import Mix


@dataclass
class BenchConfig:
    argv: list[str]
    mix: Mix
    out: Path
    targets: list[str] = field(default_factory=list)  # URLs; empty: in-process engines on `model`
    model: str = "embedded"
    device: str = "cpu"
    dtype: str = "float32"
    backend: str = "torch"  # in-process: torch | onnxruntime | tensorrt
    fast_path: Any = None  # in-process torch: backends.fast_path.FastPathOptions (--compile, --deterministic)
    weights: Any = None  # in-process torch: pipelines.weights.Weights (--transformer/--unet FILE, --quantize)
    contenders: list[Contender] = field(default_factory=list)
    load: str = "poisson"  # poisson | closed | trace
    rate: float | None = None
    rate_frac: float | None = None
    users: int = 8
    trace_file: str | None = None
    duration_s: float = 30.0
    warmup_s: float = 5.0
    drain_s: float | None = None  # default: max(5 s, 3 x SLO)
    sweep: bool = False
    sweep_rates: list[float] = field(default_factory=list)  # a fixed grid in req/s
    sweep_fracs: list[float] = field(default_factory=list)  # a fixed grid as fractions of capacity
    sweep_start_frac: float = 0.15  # search (no grid): start rate, factor, cap and bisection steps
    sweep_factor: float = 1.5
    sweep_max_frac: float = 1.5
    sweep_refine: int = 3
    sweep_duration_s: float | None = None
    sweep_min_requests: int = 50
    slo_p95_ms: float | None = None
    slo_x_idle: float = 2.0
    repeats: int = 1
    seed: int = 0
    capacity_duration_s: float = 10.0
    api_key: str | None = None
    progress: bool = True
    keep_images: bool = False  # keep generated images on the runs (sample sheets)
    quality: bool = False  # PSNR / SSIM of step-cached images against uncached ones (in process; bench/quality.py)
    lora_dir: str | None = None  # in process: LoRA adapters loaded from this folder (a mix's `lora` names them)
    controlnet_dir: str | None = None  # in process: ControlNets served from this folder (a mix's `control`)
    ip_adapter_dir: str | None = None  # in process: IP-Adapters served from this folder (a mix's `ip_adapter`)
    threads: int | None = None  # torch CPU threads; None: all cores but one (that one runs the load generator)
    timeout_s: float | None = None  # every request's deadline in seconds; None: no deadline (unless timeout_slo)
    timeout_slo: bool = False  # every request's deadline is the run's SLO
    latency_model: Any = None  # slo contenders: a LatencyModel, a file path, or None (measure it on the executor)
    peers: list[Any] = field(default_factory=list)  # --peers: PeerSettings; the contenders then run as stepserve serve

    @property
    def has_deadlines(self) -> bool:
        return self.timeout_s is not None or self.timeout_slo
