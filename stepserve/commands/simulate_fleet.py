"""`stepserve simulate --replicas N ...`: the flags that make every contender a fleet of replicas behind a router
(stepserve/sim/fleet.py), taken out of the command line before the bench parser reads the rest."""

from __future__ import annotations

import argparse
import math

from ..fleet.routers import ROUTERS
from ..sim.autoscale import POLICIES
from ..sim.fleet_run import FleetSettings

EPILOG = """fleet flags (simulate only; docs/SCALING.md):
  --replicas N          every contender is N replicas behind a router (default 1: one engine); --rate-frac is
                        then of N replicas' capacity (with --autoscale: of those it starts with), and
                        closed-loop --users are per replica; a replica holds the devices of its latency
                        model's parallel degree (`stepserve profile --ulysses-degree 2`: two)
  --router R            how requests are spread (default least_work); allowed: {routers}
  --autoscale MIN:MAX   start and drain replicas during the run (--replicas: how many at the start)
  --autoscale-policy P  slo (default: the predicted backlog against the run's SLO) or ray (Ray Serve's default,
                        as modelled: requests in flight per replica)
  --target-ongoing-requests T  with --autoscale-policy ray (default 2, Ray's)
  --autoscale-utilisation U  with --autoscale-policy slo: how busy a replica may be (default 0.8); lower starts
                        replicas sooner and keeps more through a lull
  --startup-s S         a started replica serves after this long (default: the latency model's `load_s`, else 30)
  --publish-every-s P   replicas publish their stats this often (default 0: the router reads them fresh)
  --adapter-load-s S    a replica loads an adapter it does not hold in this long (a mix's `lora` names them)
  --fail-replica R@T    replica R is lost at T seconds (repeatable); what it held fails and is counted
""".format(routers=", ".join(ROUTERS))


class FleetUsageError(ValueError):
    pass


def split_fleet(argv: list[str]) -> tuple[list[str], FleetSettings]:
    """(the other flags, the fleet's settings); a bad value raises FleetUsageError with one line."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --target is the bench's, not ours
    for flag in ("--replicas", "--router", "--autoscale", "--autoscale-policy", "--target-ongoing-requests",
                 "--autoscale-utilisation", "--startup-s", "--publish-every-s", "--adapter-load-s"):
        p.add_argument(flag)
    p.add_argument("--fail-replica", action="append", default=[])
    known, rest = p.parse_known_args(argv)
    s = FleetSettings()
    if known.replicas is not None:
        s.replicas = _number(known.replicas, "--replicas", int, 1)
    if known.router is not None:
        if known.router not in ROUTERS:
            raise FleetUsageError(f"--router: {known.router!r} is not supported; allowed: {', '.join(ROUTERS)}")
        s.router = known.router
    if known.autoscale is not None:
        low, sep, high = known.autoscale.partition(":")
        try:
            s.autoscale = (int(low), int(high)) if sep else None
        except ValueError:
            s.autoscale = None
        if s.autoscale is None or not 1 <= s.autoscale[0] <= s.autoscale[1]:
            raise FleetUsageError(f"--autoscale: expected MIN:MAX with 1 <= MIN <= MAX (e.g. 1:8), got "
                                  f"{known.autoscale!r}")
        if known.replicas is None:
            s.replicas = s.autoscale[0]
        if not s.autoscale[0] <= s.replicas <= s.autoscale[1]:
            raise FleetUsageError(f"--replicas {s.replicas} is outside --autoscale {known.autoscale}")
    if known.autoscale_policy is not None:
        if known.autoscale_policy not in POLICIES:
            raise FleetUsageError(f"--autoscale-policy: {known.autoscale_policy!r} is not supported; allowed: "
                                  f"{', '.join(POLICIES)}")
        s.policy = known.autoscale_policy
    if known.target_ongoing_requests is not None:
        s.target_ongoing_requests = _number(known.target_ongoing_requests, "--target-ongoing-requests", float, 0,
                                            strict=True)
    if known.autoscale_utilisation is not None:
        s.utilisation = _number(known.autoscale_utilisation, "--autoscale-utilisation", float, 0, strict=True)
        if s.utilisation > 1:
            raise FleetUsageError(f"--autoscale-utilisation: a fraction in (0, 1], got {known.autoscale_utilisation}")
    if known.startup_s is not None:
        s.startup_s = _number(known.startup_s, "--startup-s", float, 0)
    if known.publish_every_s is not None:
        s.publish_every_s = _number(known.publish_every_s, "--publish-every-s", float, 0)
    if known.adapter_load_s is not None:
        s.adapter_load_s = _number(known.adapter_load_s, "--adapter-load-s", float, 0)
    for text in known.fail_replica:
        r, sep, t = text.partition("@")
        try:
            s.failures.append((int(r), float(t)))
        except ValueError:
            sep = ""
        if not sep or s.failures[-1][0] < 0 or not s.failures[-1][1] >= 0:
            raise FleetUsageError(f"--fail-replica: expected R@T (replica index >= 0, seconds >= 0), got {text!r}")
    if (known.autoscale_policy or known.target_ongoing_requests or known.startup_s
            or known.autoscale_utilisation) and not s.autoscale:
        raise FleetUsageError("--autoscale-policy, --target-ongoing-requests, --autoscale-utilisation and "
                              "--startup-s steer the autoscaler; add --autoscale MIN:MAX")
    if known.autoscale_utilisation and s.policy != "slo":
        raise FleetUsageError("--autoscale-utilisation steers the slo policy; --autoscale-policy ray takes "
                              "--target-ongoing-requests")
    if any(r >= (s.autoscale[1] if s.autoscale else s.replicas) for r, _ in s.failures):
        raise FleetUsageError("--fail-replica: no such replica (replicas are numbered from 0)")
    return rest, s


def _number(text: str, flag: str, kind, low: float, strict: bool = False):
    try:
        value = kind(text)
    except ValueError:
        raise FleetUsageError(f"{flag}: {text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(value) or (value <= low if strict else value < low):
        raise FleetUsageError(f"{flag}: must be {'>' if strict else '>='} {low:g}, got {text}")
    return value
