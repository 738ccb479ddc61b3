"""The Host check of a keyless server (DNS rebinding).

A server without an API key trusts whoever can reach it. A web page on evil.example can still reach a server on
127.0.0.1: it makes evil.example resolve to 127.0.0.1 (a short-lived DNS answer, then the rebinding), and the
browser, seeing one origin, lets the page read every answer, so it drives the API with no CORS check in the way. The
browser sends `Host: evil.example` all along: that is what gives the rebinding away. So without an API key the
server answers only the Host names of the address it listens on, and those the operator adds (`--allowed-host`):
- on loopback (127.0.0.0/8, ::1, localhost): localhost, 127.0.0.1 and [::1] (and the address itself);
- on one address: that address (and localhost names when it is loopback);
- on every address (0.0.0.0, ::): any IP address written as such (a page cannot rebind an address, only a name)
  and localhost;
- off loopback, also the machine's own host name (socket.gethostname(): a page's site cannot be named so);
- a name to listen on: that name.
The port is not compared; names match without case and without a trailing dot. `--allowed-host '*'` turns the
check off (a proxy in front that checks Host itself). Anything else is a 403 in the OpenAI error shape. /health is
always answered (load balancers probe it by address). With an API key any Host is served: a page cannot send the key.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from .errors import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
ANY_ADDRESS = ("", "0.0.0.0", "::", "[::]")
OPEN_PATHS = ("/health",)


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def normal(host: str) -> str:
    """A Host header's name: lower case, no port, no trailing dot; an IPv6 address in brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        name = host[:host.find("]") + 1] if "]" in host else host
    else:
        name, colon, port = host.rpartition(":")
        name = name if colon and port.isdigit() else host
    name = name.rstrip(".")
    address = _address(name)
    return f"[{address}]" if address is not None and address.version == 6 else str(address or name)


@dataclass(frozen=True)
class ServedHosts:
    """The Host names a keyless server answers (see the module)."""

    names: frozenset[str]
    any_address: bool = False  # every IP address written as such (the server listens on all of them)
    everything: bool = False  # --allowed-host '*'

    @classmethod
    def of(cls, listen_host: str, allowed: tuple[str, ...] | list[str] = (),
           machine: str | None = None) -> "ServedHosts":
        """`machine`: this machine's host name (default socket.gethostname())."""
        names = {normal(a) for a in allowed if a.strip() != "*"}
        listen = listen_host.strip().lower()
        any_address = listen in ANY_ADDRESS
        address = _address(listen)
        loopback = listen == "localhost" or (address is not None and address.is_loopback)
        if any_address or loopback:
            names.update(LOOPBACK_NAMES)
        if not any_address:
            names.add(normal(listen))
        if not loopback:
            names.add(normal(machine if machine is not None else socket.gethostname()))
        return cls(frozenset(names), any_address, any(a.strip() == "*" for a in allowed))

    def serves(self, host: str | None) -> bool:
        if self.everything:
            return True
        if not host:
            return False
        name = normal(host)
        return name in self.names or (self.any_address and _address(name) is not None)

    def shown(self) -> str:
        listed = sorted(self.names) + (["any IP address"] if self.any_address else [])
        return ", ".join(listed)


class HostCheck:
    """ASGI middleware: a request whose Host is not served gets 403 `host_not_allowed` (see the module)."""

    def __init__(self, app, hosts: ServedHosts) -> None:
        self.app, self.hosts = app, hosts

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        host = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == b"host"), None)
        if self.hosts.serves(host):
            return await self.app(scope, receive, send)
        error = APIError(403, f"Host {(host or '')[:100]!r} is not served here: without an API key this server "
                              f"answers only the Host names {self.hosts.shown()}; add a name with --allowed-host "
                              f"NAME, or require an API key", type="permission_error", code="host_not_allowed",
                         param="Host")
        await error.response()(scope, receive, send)
