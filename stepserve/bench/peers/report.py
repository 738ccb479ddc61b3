"""report.md's lines about the contenders of a --peers run: each one's server, versions and batching settings."""

from __future__ import annotations

from typing import Any


def peer_lines(peers: list[dict[str, Any]]) -> list[str]:
    lines = ["- Contenders: each its own server on 127.0.0.1, started fresh for every run and stopped after it "
             "(with every process it started); the same model, networks, samplers and threads in each, so only "
             "the batching differs:"]
    for p in peers:
        versions = ", ".join(f"{k} {v}" for k, v in p["versions"].items())
        config = ", ".join(f"{k} {v}" for k, v in p["config"].items())
        lines.append(f"  - {p['name']} ({versions}): {config}")
    return lines
