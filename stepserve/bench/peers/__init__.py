"""Peer servers for `stepserve bench --peers triton,ray,litserve`: each peer on loopback serving the same model with
the same per-step work (handler.py), batched the way its docs advise, driven with the same trace as `stepserve
serve`, and stopped with every process it started (process.py). One module per peer: ray_serve.py,
litserve_peer.py, triton_peer.py; the registry (registry.py) knows their settings and how each is launched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .registry import PEERS, PeerContext, PeerSetting, parse_peers, record

__all__ = ["PEERS", "PeerContext", "PeerSetting", "parse_peers", "peer_makers", "peer_records", "stepserve_settings"]


def stepserve_settings(cfg) -> list[PeerSetting]:
    """`stepserve serve` contenders: one per bench contender (--strategies; continuous by default with --peers)."""
    return [PeerSetting("stepserve", c.max_batch_size, c.max_queue_delay_ms, c.strategy) for c in cfg.contenders]


def _context(cfg) -> PeerContext:
    """Server logs (and Triton's repositories) go to OUT/peers/, one folder per run."""
    return PeerContext(_handler(cfg), Path(cfg.out) / "peers")


def peer_makers(cfg) -> tuple[list, Any]:
    """(a TargetMaker per contender, the reference for idle latency and capacity: stepserve serve, continuous)."""
    from ..runner import TargetMaker
    from .target import PeerTarget

    ctx = _context(cfg)
    settings = stepserve_settings(cfg) + list(cfg.peers)
    makers = [TargetMaker(s.name, lambda s=s: PeerTarget(s, ctx, cfg.keep_images)) for s in settings]
    reference = next((s for s in settings if s.peer == "stepserve" and s.strategy == "continuous"),
                     PeerSetting("stepserve", ctx.handler.max_batch_size, None, "continuous"))
    return makers, TargetMaker(reference.name, lambda: PeerTarget(reference, ctx))


def peer_records(cfg) -> list[dict[str, Any]]:
    """results.json's settings.peers: every contender's peer, versions and configuration."""
    handler = _handler(cfg)
    return [record(s, handler) for s in stepserve_settings(cfg) + list(cfg.peers)]


def _handler(cfg):
    from ...engine.loading import default_threads
    from .handler import HandlerOptions

    return HandlerOptions(cfg.model, cfg.backend, cfg.device, cfg.dtype, cfg.threads or default_threads(),
                          max(c.max_batch_size for c in cfg.contenders))
