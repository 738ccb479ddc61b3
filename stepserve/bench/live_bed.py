"""The live testbed: in-process engines sharing one executor (loaded once), servers given by URL (--target), or
stepserve and its peers on loopback (--peers), all on the wall clock."""

from __future__ import annotations

import time

from ..engine.loading import default_threads
from .config import BenchConfig
from .live import LiveDriver
from .quality import uncached_images
from .remote import server_target
from .results import Startup
from .runner import TargetMaker
from .targets import Contender, EngineTarget
from .testbed import Described, Makers, Testbed


def live_testbed(cfg: BenchConfig) -> Testbed:
    """In-process engines on `cfg.model`, servers (--target) or peers on loopback (--peers), on the wall clock."""
    if not cfg.targets and not cfg.peers and cfg.model != "fake":
        import torch

        torch.set_num_threads(cfg.threads or default_threads())
    startup = Startup(model_load_s=None)
    makers = _makers(cfg, startup)
    return Testbed(LiveDriver(), makers, _remote_kind(cfg.targets) if cfg.targets else cfg.device,
                   _described(cfg), startup)


def _makers(cfg: BenchConfig, startup: Startup) -> Makers:
    if cfg.peers:  # every contender its own server on loopback (bench/peers), stepserve serve the reference
        from .peers import peer_makers

        return Makers(*peer_makers(cfg))
    if cfg.targets:
        makers = [TargetMaker(*server_target(t, cfg.api_key, cfg.keep_images)) for t in cfg.targets]
        return Makers(makers, makers[0])
    t0 = time.monotonic()
    executor = load_model(cfg)
    startup.model_load_s = time.monotonic() - t0
    latency, source = _latency_model(cfg, executor, startup)
    keep = cfg.keep_images or cfg.quality
    makers = [TargetMaker(c.name, lambda c=c: EngineTarget(executor, c, keep, latency)) for c in cfg.contenders]
    batch = max((c.max_batch_size for c in cfg.contenders), default=8)
    reference = Contender("continuous", max_batch_size=batch)
    return Makers(makers, TargetMaker(reference.name, lambda: EngineTarget(executor, reference)), latency, source,
                  uncached=uncached_images(executor, batch))


def _latency_model(cfg: BenchConfig, executor, startup: Startup):
    """The one LatencyModel every slo contender predicts with, and where it came from; (None, None) when no
    contender is slo. Given, loaded, or measured on the shared executor (engine_config.resolve_latency_model, as
    every engine does); measuring it is start-up, timed into startup.latency_model_s, never inside a run."""
    from ..engine.config import resolve_latency_model

    slo = [c for c in cfg.contenders if c.strategy == "slo"]
    if not slo:
        return None, None
    batch = max(c.max_batch_size for c in slo)
    t0 = time.monotonic()
    latency = resolve_latency_model(cfg.latency_model or "measure", executor, batch, progress=cfg.progress)
    if cfg.latency_model is None:
        startup.latency_model_s = time.monotonic() - t0
        return latency, f"measured on the benchmark's executor up to batch size {batch}"
    return latency, "given" if latency is cfg.latency_model else f"loaded from {cfg.latency_model}"


def load_model(cfg: BenchConfig):
    """The executor every in-process contender shares: built once (stepserve.engine.config), without the memory
    cap (a contender's max_batch_size is what the run compares), with the fast path when asked; `fake` is the
    sleeping fake executor (no model)."""
    from ..engine.config import EngineConfig, EngineOptions, build_engine

    fake = None
    if cfg.model == "fake":
        from ..costs import FakeExecutor

        fake = FakeExecutor(sleep=True)  # the fake model on the wall clock: it sleeps what it charges
    batch = max((c.max_batch_size for c in cfg.contenders), default=8)
    config = EngineConfig(model=cfg.model, device=cfg.device, dtype=cfg.dtype, backend=cfg.backend, memory_cap=False,
                          fast_path=cfg.fast_path if fake is None else None, lora_dir=cfg.lora_dir,
                          controlnet_dir=cfg.controlnet_dir, ip_adapter_dir=cfg.ip_adapter_dir,
                          weights=cfg.weights if fake is None else None,
                          options=EngineOptions(max_batch_size=batch))
    return build_engine(config, executor=fake).executor


def _remote_kind(targets: list[str]) -> str:
    """What the load went to: "http" (stepserve's API), "triton" (KServe v2), or both."""
    from .triton_target import is_triton_target

    kinds = sorted({"triton" if is_triton_target(t) else "http" for t in targets})
    return "+".join(kinds)


def _described(cfg: BenchConfig) -> Described:
    target = ", ".join(cfg.targets) if cfg.targets else f"in-process engine, model {cfg.model}"
    peers = []
    if cfg.peers:
        from .peers import peer_records

        target, peers = f"servers on loopback (stepserve serve and peers), model {cfg.model}", peer_records(cfg)
    return Described(target, None if cfg.targets else cfg.model, cfg.device, cfg.dtype, cfg.backend, peers)
