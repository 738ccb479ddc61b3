"""Which peers `stepserve bench --peers` knows, their batching settings, and how each one is launched.

    --peers triton,ray,litserve          each peer at its default grid: max batch 4 and 8 x wait 10 and 50 ms
    --peers ray@8x50,litserve@4x10       one setting each: max batch 8, wait 50 ms; max batch 4, wait 10 ms

The wait is each peer's own knob: Ray Serve's `@serve.batch(batch_wait_timeout_s=)`, LitServe's
`LitAPI(batch_timeout=)`, Triton's `dynamic_batching { max_queue_delay_microseconds }`. stepserve itself runs as
`stepserve serve` (one contender per --strategies entry, continuous by default) on the same terms.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ...util.ports import free_port, free_ports
from .handler import HandlerOptions
from .process import PeerProcess, file_ready, url_ready

PEERS = ("triton", "ray", "litserve")
DEFAULT_BATCH_SIZES = (4, 8)
DEFAULT_WAITS_MS = (10.0, 50.0)
# The packages whose versions results.json records for each peer
PACKAGES = {"stepserve": ("stepserve", "fastapi", "uvicorn"), "ray": ("ray",), "litserve": ("litserve", "fastapi"),
            "triton": ("nvidia-pytriton", "tritonclient", "onnxruntime")}
WAIT_KNOB = {"ray": "@serve.batch batch_wait_timeout_s", "litserve": "LitAPI batch_timeout",
             "triton": "dynamic_batching max_queue_delay"}
BATCH_KNOB = {"ray": "@serve.batch max_batch_size", "litserve": "LitAPI max_batch_size",
              "triton": "max_batch_size (dynamic_batching)"}


@dataclass(frozen=True)
class PeerSetting:
    """One contender: a peer with one batching setting. peer "stepserve" carries a strategy instead."""

    peer: str
    max_batch_size: int
    wait_ms: float | None = None
    strategy: str | None = None  # stepserve only

    @property
    def name(self) -> str:
        if self.peer == "stepserve":
            delay = f"({self.wait_ms:g}ms)" if self.strategy == "dynamic" else ""
            return f"stepserve-{self.strategy}{delay}"
        return f"{self.peer}(b{self.max_batch_size},{self.wait_ms:g}ms)"


@dataclass(frozen=True)
class Launch:
    """How one contender's server is started, where it answers, and what is recorded about it."""

    process: PeerProcess
    protocol: str  # "http" (stepserve's images API) | "triton" (KServe v2 over gRPC)
    url: str


@dataclass
class PeerContext:
    """What every contender shares: the model, backend and threads, and a folder for logs and repositories."""

    handler: HandlerOptions
    workdir: Path
    extra: dict[str, Any] = field(default_factory=dict)


def parse_peers(text: str, max_batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES,
                waits_ms: tuple[float, ...] = DEFAULT_WAITS_MS) -> list[PeerSetting]:
    """'triton,ray@8x50,...' -> settings, in order; ValueError names what is wrong and what is allowed."""
    usage = (f"expected a comma-separated list of {', '.join(PEERS)}, each optionally @BATCHxWAIT_MS (e.g. "
             "ray@8x50: max batch 8, wait 50 ms); a bare name runs max batch "
             f"{'/'.join(map(str, max_batch_sizes))} x wait {'/'.join(f'{w:g}' for w in waits_ms)} ms")
    out: list[PeerSetting] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, setting = item.partition("@")
        if name not in PEERS:
            raise ValueError(f"--peers: unknown peer {name!r}; {usage}")
        if not setting:
            out += [PeerSetting(name, b, w) for b in max_batch_sizes for w in waits_ms]
            continue
        batch, _, wait = setting.partition("x")
        try:
            b, w = int(batch), float(wait)
        except ValueError:
            raise ValueError(f"--peers: {item!r} is not NAME@BATCHxWAIT_MS; {usage}") from None
        if b < 1 or not w >= 0:
            raise ValueError(f"--peers: {item!r}: the batch must be >= 1 and the wait >= 0 ms")
        out.append(PeerSetting(name, b, w))
    if not out:
        raise ValueError(f"--peers: nothing given; {usage}")
    return list(dict.fromkeys(out))


def versions(peer: str) -> dict[str, str]:
    out = {}
    for name in PACKAGES[peer]:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def record(setting: PeerSetting, handler: HandlerOptions) -> dict[str, Any]:
    """What results.json says about a contender: the peer, its versions, and its configuration in its own terms."""
    if setting.peer == "stepserve":
        config = {"server": "stepserve serve", "strategy": setting.strategy, "max_batch_size": setting.max_batch_size}
        if setting.strategy == "dynamic":
            config["max_queue_delay_ms"] = setting.wait_ms
    else:
        config = {BATCH_KNOB[setting.peer]: setting.max_batch_size, WAIT_KNOB[setting.peer] + " (ms)": setting.wait_ms}
        config.update(_fixed_config(setting.peer))
    config.update({"model": handler.model, "backend": handler.backend, "device": handler.device,
                   "dtype": handler.dtype, "threads": handler.threads})
    return {"name": setting.name, "peer": setting.peer, "versions": versions(setting.peer), "config": config}


def _fixed_config(peer: str) -> dict[str, Any]:
    if peer == "ray":
        from .ray_serve import MAX_ONGOING_REQUESTS

        return {"replicas": 1, "max_ongoing_requests": MAX_ONGOING_REQUESTS, "replica num_cpus": 0,
                "handler": "batch in a thread (asyncio.to_thread); one batch at a time"}
    if peer == "litserve":
        return {"workers_per_device": 1, "num_api_servers": 1, "accelerator": "cpu", "timeout": False}
    return {"layout": "classic (stepserve export triton --mode classic)", "networks": "onnxruntime (Python backend)",
            "instances": 1, "protocol": "gRPC"}


def launch(setting: PeerSetting, ctx: PeerContext, index: int) -> Launch:
    """The server for one run of a contender (not started yet)."""
    h = ctx.handler
    if setting.peer != "stepserve":
        h = HandlerOptions(h.model, h.backend, h.device, h.dtype, h.threads, setting.max_batch_size)
    run_dir = ctx.workdir / f"{index:03d}-{setting.peer}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "server.log"
    (run_dir / "ready").unlink(missing_ok=True)  # a folder of an earlier bench with the same --out
    python = [sys.executable, "-m"]
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(h.threads)}
    if setting.peer == "stepserve":
        port = free_port()
        argv = python + ["stepserve.cli", "serve", "--model", h.model, "--backend", h.backend, "--device", h.device,
                         "--dtype", h.dtype, "--threads", str(h.threads), "--strategy", setting.strategy,
                         "--max-batch-size", str(setting.max_batch_size), "--port", str(port),
                         "--log-level", "warning"]
        if setting.strategy == "dynamic":
            argv += ["--max-queue-delay-ms", f"{setting.wait_ms:g}"]
        url = f"http://127.0.0.1:{port}"
        return Launch(PeerProcess(setting.name, argv, url_ready(url + "/health"), log, env), "http", url)
    wait = ["--wait-ms", f"{setting.wait_ms:g}"]
    if setting.peer == "ray":
        port, ready = free_port(), run_dir / "ready"
        argv = python + ["stepserve.bench.peers.ray_serve", "--port", str(port), "--ready-file", str(ready),
                         *wait, *h.argv()]
        return Launch(PeerProcess(setting.name, argv, file_ready(ready), log, env), "http", f"http://127.0.0.1:{port}")
    if setting.peer == "litserve":
        port = free_port()
        argv = python + ["stepserve.bench.peers.litserve_peer", "--port", str(port), *wait, *h.argv()]
        url = f"http://127.0.0.1:{port}"
        return Launch(PeerProcess(setting.name, argv, url_ready(url + "/health"), log, env), "http", url)
    ports, ready = free_ports(3), run_dir / "ready"
    argv = python + ["stepserve.bench.peers.triton_peer", "--repo", str(run_dir / "repo"), "--http-port",
                     str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), "--ready-file",
                     str(ready), *wait, *h.argv()]
    return Launch(PeerProcess(setting.name, argv, file_ready(ready), log, env), "triton",
                  f"grpc://127.0.0.1:{ports[1]}/pipeline")
