"""Which target a `--target` string names: stepserve's HTTP API ('URL', 'label=URL') or a Triton model over
KServe v2 ('triton=URL', 'triton:label=URL'). Kept apart from both target modules, which it imports."""

from __future__ import annotations

import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from .targets import HttpTarget, Target
from .triton_target import TritonTarget, is_triton_target, parse_triton_target


def server_target(text: str, api_key: str | None = None,
                  keep_images: bool = False) -> tuple[str, Callable[[], Target]]:
    """(label, factory) for a --target. A malformed Triton URL raises ValueError."""
    if is_triton_target(text):
        address = parse_triton_target(text)
        return address.label, lambda: TritonTarget(address, keep_images)
    name, url = text.split("=", 1) if "=" in text and not text.split("=", 1)[0].startswith("http") else (text, text)
    return name, lambda: HttpTarget(url, name, api_key)


def check_reachable(text: str, timeout_s: float = 5.0) -> None:
    """Something listens at a --target's address (one TCP connection, closed at once); else ValueError naming the
    address and the fix, before any request or report is made."""
    url = parse_triton_target(text).url if is_triton_target(text) else server_target(text)[1]().base
    parts = urlsplit(url)
    try:
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"--target {text!r}: the port is not a number; expected a URL such as "
                         f"http://127.0.0.1:8000") from None
    if not host or parts.scheme not in ("http", "https", "grpc"):
        raise ValueError(f"--target {text!r}: expected a URL such as http://127.0.0.1:8000")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"--target {text!r}: nothing answers at {host}:{port} ({reason.lower()}); start the "
                         f"server first (stepserve serve --port {port}) or give the address it listens on") from None
