"""`stepserve serve`'s flags for who may call the server and where it may call out (docs/HTTP_API.md, "Webhooks"
and "Host names"): `--allowed-host NAME` (the Host names a keyless server answers besides its own address's:
server/hosts.py) and `--webhook-allow CIDR|HOST` (internal receivers webhooks may reach: jobs/targets.py). Both
repeatable; what they ask for travels in ServeSettings."""

from __future__ import annotations

import argparse

from ..jobs.targets import ALLOW_FORMS, parse_allow
from ..server.startup import StartupError


def add_network_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the network: which Host names are served, where webhooks may go")
    g.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                   help="without an API key the server answers only the Host names of the address it listens on "
                        "(localhost, 127.0.0.1, [::1] on loopback) and 403 to any other (DNS rebinding); this adds "
                        "a name (repeatable; '*': any, for a proxy in front that checks Host itself)")
    g.add_argument("--webhook-allow", action="append", default=None, metavar="CIDR|HOST",
                   help=f"webhooks go only to public addresses (loopback, private, link-local, shared, multicast "
                        f"and reserved ones are refused); this allows an internal receiver: {ALLOW_FORMS} "
                        f"(repeatable)")


def network_settings(args: argparse.Namespace) -> dict:
    """The ServeSettings fields these flags set. StartupError (one line) for a --webhook-allow that is neither a
    network nor a host name."""
    allow = tuple(args.webhook_allow or ())
    for entry in allow:
        try:
            parse_allow(entry)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
    return {"webhook_allow": allow, "allowed_hosts": tuple(args.allowed_host or ())}
