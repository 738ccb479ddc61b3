"""Free local TCP ports for servers this package starts as child processes (bench peers, Triton)."""

from __future__ import annotations

import socket
from contextlib import ExitStack


def free_ports(n: int) -> list[int]:
    """n distinct ports free on 127.0.0.1 now. All n sockets stay bound until every port is chosen: asking for one
    port at a time can hand out the same port twice, since each is free again once its socket closes."""
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def free_port() -> int:
    return free_ports(1)[0]
