"""Which parallel degree a latency model was measured (or derived) at: how many devices one replica holds.

A replica that splits each request over N devices (sequence, CFG or tensor parallel: stepserve.parallel) steps
faster than one device, and holds N of them. Its latency model says so in the metadata, under `parallel`:
{"ulysses": 2, "ring": 1, "cfg": false, "tensor": 1, "devices": 2}. `stepserve profile` writes it for the degree it
ran at; a model without it was measured on one device. The simulator charges each replica its own model, so a
replica of degree N steps with the degree-N curve, and capacity planning (`stepserve plan --devices`) counts N
devices for it.

`at_degree` derives a degree-N model from a one-device model and a step speed-up (published scaling figures, for
hardware this machine cannot measure): only the denoising steps are split (the text encoders and the VAE run
whole, as stepserve runs them), so encode and decode keep the one-device curves. Pure data: no torch.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from .latency_model import Curve, LatencyModel

PARALLEL_KEY = "parallel"
KINDS = ("ulysses", "ring", "cfg", "tensor")


def parallel_entry(ulysses: int = 1, ring: int = 1, cfg: bool = False, tensor: int = 1) -> dict[str, Any]:
    """The metadata entry for these degrees; `devices` is their product (CFG parallel counts 2)."""
    devices = ulysses * ring * tensor * (2 if cfg else 1)
    return {"ulysses": ulysses, "ring": ring, "cfg": bool(cfg), "tensor": tensor, "devices": devices}


def devices_of(latency: LatencyModel) -> int:
    """Devices one replica of this model holds (1 when the metadata names no parallel degree); a malformed entry
    raises ValueError saying what it should be."""
    entry = latency.metadata.get(PARALLEL_KEY)
    if entry is None:
        return 1
    n = entry.get("devices") if isinstance(entry, Mapping) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"latency model metadata {PARALLEL_KEY!r}: expected an object with 'devices' (an integer "
                         f">= 1) and the degrees {', '.join(KINDS)}; got {entry!r}")
    return n


def degree_label(latency: LatencyModel) -> str:
    """'1 device', or the kinds and degrees ('ulysses 4', 'ulysses 2 + cfg')."""
    entry = latency.metadata.get(PARALLEL_KEY)
    if devices_of(latency) == 1:
        return "1 device"
    parts = [f"{k} {entry[k]}" for k in ("ulysses", "ring", "tensor") if int(entry.get(k, 1)) > 1]
    return " + ".join(parts + (["cfg"] if entry.get("cfg") else [])) or f"{entry['devices']} devices"


def at_degree(base: LatencyModel, step_scale: float, parallel: Mapping[str, Any], figures: Sequence[str] = (),
              assumptions: Sequence[str] = ()) -> LatencyModel:
    """`base` (one device) at a parallel degree: every step curve times `step_scale` (the degree's step time over
    one device's, < 1 when splitting pays), encode and decode as they are, `parallel` (parallel_entry) recorded.
    `figures` and `assumptions` are added to the metadata's lists of the same names."""
    if devices_of(base) != 1:
        raise ValueError(f"at_degree derives from a one-device model; this one holds {devices_of(base)} devices")
    if not 0 < step_scale:
        raise ValueError(f"step_scale must be > 0, got {step_scale}")

    def scaled(curve: Curve) -> Curve:
        return Curve(tuple((n, round(s * step_scale, 6)) for n, s in curve.points))

    meta = copy.deepcopy(dict(base.metadata))
    meta[PARALLEL_KEY] = dict(parallel)
    meta["step_scale_from_one_device"] = round(step_scale, 6)
    meta["figures"] = list(meta.get("figures", [])) + list(figures)
    meta["assumptions"] = list(meta.get("assumptions", [])) + list(assumptions)
    for entry in meta.get("by_guidance_rows", {}).values():  # the curves with / without guidance rows, alike
        for curve in entry.get("step", []):
            curve["points"] = [[n, round(s * step_scale, 6)] for n, s in curve["points"]]
    return LatencyModel(step={b: scaled(c) for b, c in base.step.items()}, encode=base.encode, decode=base.decode,
                        reference_bucket=base.reference_bucket, metadata=meta)
