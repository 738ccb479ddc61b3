"""Where a webhook may be sent: public addresses only, unless the operator names an internal receiver.

A webhook URL is the client's, and the server POSTs to it from inside its own network: without a check a client
could make the server call its cloud's metadata service (169.254.169.254), an admin port on loopback or any host of
the private network, and read what answered there from the delivery's state (SSRF). So a webhook whose host is, or
resolves to, an address that is not public is refused:
- loopback, link-local, private (RFC 1918, IPv6 unique-local), shared (100.64.0.0/10), multicast, reserved,
  unspecified, documentation and benchmarking ranges, IPv6 site-local: every address Python's `ipaddress` does not
  call global, multicast and reserved ones too;
- an IPv6 address that carries an IPv4 one (IPv4-mapped ::ffff:a.b.c.d, NAT64 64:ff9b::/96, 6to4 2002::/16,
  Teredo) is judged by that IPv4 address as well.
A name is refused when any of its addresses is refused (the connection would pick one of them).

The check runs twice: when the job is made (a 400 naming `webhook`) and again before every attempt, whose
connection then goes to the addresses that were just checked and to no other (webhooks.py pins them: a name that
resolved to a public address at creation and to loopback later, a DNS rebinding, is never connected to).

Operators whose receivers are internal name them (`serve --webhook-allow CIDR|HOST`, repeatable): an address inside
an allowed network is accepted, and so is every address of an allowed host name (matched without case, whole name).
No I/O at import; resolution is `resolve_host` (the system resolver), looked up at each call so tests can replace it.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
NAT64 = ipaddress.ip_network("64:ff9b::/96")
ALLOW_FORMS = ("an IP network in CIDR form (10.0.0.0/8, fd00::/8), one address (10.1.2.3) or a host name "
               "(hooks.internal)")


class WebhookTargetError(ValueError):
    """A webhook URL the server will not call. The message (a client's 400) says what is refused and how an operator
    allows it, in one line; it never says what a name resolved to (that would map the inside for the client), nor
    whether it resolved at all: `detail` does, for the server's log."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message


REFUSAL = ("webhooks are sent only to public addresses (loopback, link-local, private, shared, multicast and reserved "
           "ones are refused); an operator allows an internal receiver with serve --webhook-allow CIDR|HOST")


def resolve_host(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for host:port (TCP), in its order. OSError when there is none."""
    return list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))


def embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, NAT64, 6to4, Teredo's client), else None."""
    if address.version != 6:
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    return address.teredo[1] if address.teredo is not None else None


def is_public(address: Address) -> bool:
    """Global, unicast and not reserved (and so is any IPv4 address it carries)."""
    if not address.is_global or address.is_multicast or address.is_reserved or address.is_unspecified \
            or getattr(address, "is_site_local", False):  # IPv6 fec0::/10, deprecated but still routed inside
        return False
    inner = embedded_ipv4(address)
    return inner is None or is_public(inner)


def parse_allow(entry: str) -> Network | str:
    """One --webhook-allow entry: a network (an address is a /32 or /128) or a lower-case host name. ValueError
    naming the entry and the allowed forms."""
    text = entry.strip()
    try:
        return ipaddress.ip_network(text.strip("[]"), strict=False)
    except ValueError:
        pass
    name = text.lower().rstrip(".")
    labels = name.split(".")
    if not name or len(name) > 253 or not all(l and len(l) <= 63 and l.replace("-", "").isalnum() for l in labels):
        raise ValueError(f"--webhook-allow {entry!r}: not a network, an address or a host name; allowed: {ALLOW_FORMS}")
    return name


@dataclass(frozen=True)
class WebhookTargets:
    """The check, with the operator's allowances. `resolve`: (host, port) -> addresses (default resolve_host)."""

    networks: tuple[Network, ...] = ()
    hosts: frozenset[str] = frozenset()
    resolve: Callable[[str, int], list[str]] | None = None

    @classmethod
    def allowing(cls, entries: Iterable[str] = (), resolve: Callable[[str, int], list[str]] | None = None
                 ) -> "WebhookTargets":
        parsed = [parse_allow(e) for e in entries]
        return cls(tuple(p for p in parsed if not isinstance(p, str)),
                   frozenset(p for p in parsed if isinstance(p, str)), resolve)

    def addresses(self, url: str) -> list[str]:
        """The addresses a POST to `url` may connect to (all of its host's, each checked): WebhookTargetError when
        the host is, or resolves to, an address that is not public and not allowed, or does not resolve. Blocking
        (the resolver): call it off the event loop."""
        parts = urlsplit(url)
        host, port = (parts.hostname or "").rstrip("."), parts.port or (443 if parts.scheme == "https" else 80)
        if not host:
            raise WebhookTargetError("webhook: the URL names no host; give an http:// or https:// URL with one")
        try:
            literal = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            literal = None
        if literal is not None:
            if not self._allows(literal):
                raise WebhookTargetError(f"webhook: {host} is not a public address; {REFUSAL}")
            return [str(literal)]
        refused = f"webhook: the host {host[:100]!r} does not resolve to public addresses only; {REFUSAL}"
        try:
            found = (self.resolve or resolve_host)(host, port)
        except (OSError, UnicodeError) as exc:
            raise WebhookTargetError(refused, f"{host} does not resolve: {exc}") from None
        if not found:
            raise WebhookTargetError(refused, f"{host} resolves to no address")
        if host.lower() in self.hosts:
            return found
        inside = [a for a in found if not self._allows(ipaddress.ip_address(a.split("%", 1)[0]))]
        if inside:
            raise WebhookTargetError(refused, f"{host} resolves to {', '.join(inside)}, not public")
        return found

    def _allows(self, address: Address) -> bool:
        return is_public(address) or any(address in n for n in self.networks if n.version == address.version)
