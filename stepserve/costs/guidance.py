"""Step and encode costs measured with and without guidance rows, kept in a LatencyModel's metadata.

A request with guidance_scale > 1 runs two rows of the denoiser's forward (conditional and unconditional) and
encodes a negative prompt too; one without runs one row. A LatencyModel's `step` curves hold one of the two (the
rows a request at the model's default guidance has; `metadata["guidance_rows"]`), which is what the `slo` policy
plans with. To charge a batch by the rows it actually runs, `stepserve profile` measures both and stores them,
backward compatibly, under `metadata["by_guidance_rows"]` (stepserve.profiling.measure writes it with
`guidance_entry`):

    "by_guidance_rows": {
      "1": {"guidance_scale": 1.0,                    # the requests of this measurement
            "step": [{"bucket": [h, w], "points": [[batch size, seconds], ...]}, ...],
            "encode": [[batch size, seconds], ...],
            "spread": {"step": [{"bucket": [h, w], "points": [[batch size, min s, max s], ...]}, ...],
                       "encode": [[batch size, min s, max s], ...]}},
      "2": {...the same, measured with guidance rows...}
    }

Counts are requests (batch size), as everywhere in a LatencyModel; the key says how many forward rows each of
them ran. Decoding does not depend on guidance and stays in the model's own `decode` curves. Readers that do not
know this key see an ordinary latency model. `by_guidance_rows(model)` reads it back, falling back to the model's
own curves for files without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .latency_model import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Bucket,
    Curve,
    LatencyModel,
)

METADATA_KEY = "by_guidance_rows"

Spread = tuple[tuple[int, float, float], ...]  # (batch size, min s, max s) of the recorded durations


@dataclass(frozen=True)
class GuidanceCurves:
    """Step and encode costs of requests that run `rows` forward rows each (1: no guidance, 2: guidance)."""

    rows: int | None  # None: not recorded (the curves are used whatever the guidance)
    step: dict[Bucket, Curve]
    encode: Curve
    step_spread: dict[Bucket, Spread]  # empty when the measurement recorded none
    encode_spread: Spread


def guidance_entry(m: LatencyModel) -> dict[str, Any]:
    spread = m.metadata.get("spread", {})
    return {
        "guidance_scale": m.metadata.get("guidance_scale"),
        "step": [{"bucket": list(b), "points": [list(p) for p in c.points]} for b, c in m.step.items()],
        "encode": [list(p) for p in m.encode.points],
        "spread": {"step": spread.get("step", []), "encode": spread.get("encode", [])},
    }


def by_guidance_rows(model: LatencyModel) -> dict[int | None, GuidanceCurves]:
    """The step/encode curves per rows-per-request: {1: ..., 2: ...} from `metadata["by_guidance_rows"]` when the
    model has it; else {guidance_rows: the model's own curves}, or {None: them} when guidance_rows is unknown.
    A malformed entry raises ValueError naming it."""
    meta = model.metadata
    entries = meta.get(METADATA_KEY)
    if entries is None:
        rows = meta.get("guidance_rows")
        rows = rows if rows in (1, 2) else None
        spread = meta.get("spread") if isinstance(meta.get("spread"), dict) else {}
        return {rows: GuidanceCurves(rows, dict(model.step), model.encode,
                                     spread_by_bucket(spread.get("step", []), "metadata.spread.step"),
                                     _spread(spread.get("encode", []), "metadata.spread.encode"))}
    where = f"metadata.{METADATA_KEY}"
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{where}: expected an object keyed by rows per request ('1', '2')")
    out: dict[int | None, GuidanceCurves] = {}
    for key, entry in entries.items():
        if key not in ("1", "2"):
            raise ValueError(f"{where}: keys are rows per request, '1' or '2', got {key!r}")
        w = f"{where}.{key}"
        if not isinstance(entry, dict) or "step" not in entry or "encode" not in entry:
            raise ValueError(f"{w}: expected an object with 'step' and 'encode'")
        # read through LatencyModel's own reader, so the curves are checked as a file's are
        data = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": entry["step"], "encode": entry["encode"],
                "decode": entry["step"]}
        curves = LatencyModel.from_dict(data, w)
        spread = entry.get("spread") or {}
        if not isinstance(spread, dict):
            raise ValueError(f"{w}.spread: expected an object with 'step' and 'encode'")
        out[int(key)] = GuidanceCurves(int(key), dict(curves.step), curves.encode,
                                       spread_by_bucket(spread.get("step", []), f"{w}.spread.step"),
                                       _spread(spread.get("encode", []), f"{w}.spread.encode"))
    return out


def spread_by_bucket(entries: Any, where: str) -> dict[Bucket, Spread]:
    """Read [{'bucket': [h, w], 'points': [[n, min s, max s], ...]}, ...] as written in metadata 'spread'."""
    if not isinstance(entries, list):
        raise ValueError(f"{where}: expected a list of {{'bucket': [h, w], 'points': [[n, min, max], ...]}}")
    out: dict[Bucket, Spread] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("bucket"), list) or len(e["bucket"]) != 2:
            raise ValueError(f"{where}[{i}]: expected an object with 'bucket' [h, w] and 'points'")
        out[(int(e["bucket"][0]), int(e["bucket"][1]))] = _spread(e.get("points", []), f"{where}[{i}].points")
    return out


def _spread(points: Any, where: str) -> Spread:
    if not isinstance(points, list):
        raise ValueError(f"{where}: expected a list of [batch size, min s, max s]")
    out = []
    for p in points:
        if (not isinstance(p, list) or len(p) != 3 or not isinstance(p[0], int) or p[0] < 1
                or not all(isinstance(x, (int, float)) and x >= 0 for x in p[1:]) or p[1] > p[2]):
            raise ValueError(f"{where}: each point must be [batch size >= 1, min s, max s >= min s], got {p!r}")
        out.append((p[0], float(p[1]), float(p[2])))
    return tuple(sorted(out))
