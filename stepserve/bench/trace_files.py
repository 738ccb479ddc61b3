"""Trace files: a Trace saved and loaded as CSV (header row) or JSONL (one request per line); see workload.py for
the fields a row may carry."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from .workload import RequestSpec, Trace, TraceItem

SPEC_FIELDS = [f.name for f in fields(RequestSpec)]
ALIASES = {"steps": "num_inference_steps"}  # trace columns accepted under another name


def save_trace(trace: Trace, path: str | Path) -> None:
    path = Path(path)
    rows = [{"offset_s": item.offset_s, **asdict(item.spec)} for item in trace.items]
    if path.suffix.lower() == ".csv":
        for row in rows:  # a cache given as a mapping, and a list of adapters, are JSON cells
            if isinstance(row["cache"], dict):
                row["cache"] = json.dumps(row["cache"])
            if row["loras"] is not None:
                row["loras"] = json.dumps(row["loras"])
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["offset_s", *SPEC_FIELDS])
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def load_trace(path: str | Path) -> Trace:
    """CSV (header row) or JSONL; each row: offset_s plus request fields (prompt required, the rest optional;
    `steps` is accepted for num_inference_steps, slo_ms is the request's own SLO and deadline)."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    items = [_row_to_item(row, i, path) for i, row in enumerate(rows)]
    items.sort(key=lambda it: it.offset_s)
    return Trace(items, f"trace {path.name} ({len(items)} requests)")


def _cache_cell(value: Any) -> Any:
    """A trace's cache: a mapping or policy name as given (JSONL), or a CSV cell (a JSON object, a name or empty)."""
    if isinstance(value, str):
        if not value.strip():
            return None
        return json.loads(value) if value.lstrip().startswith("{") else value
    return value


def _loras_cell(value: Any) -> Any:
    """A trace's loras: a list as given (JSONL), or a CSV cell holding one in JSON (or empty)."""
    if isinstance(value, str):
        return json.loads(value) if value.strip() else None
    return value


def _edit_cell(value: str | None, where: str) -> str | None:
    from .edits import EDIT_KINDS

    if value in (None, "none"):
        return None
    if value not in EDIT_KINDS:
        raise ValueError(f"{where}: edit {value!r}; allowed: none, {', '.join(EDIT_KINDS)} (or empty: a generation)")
    return value


def _strength_cell(value: float | None, where: str) -> float | None:
    if value is not None and not 0 < value <= 1:
        raise ValueError(f"{where}: strength must be in (0, 1] (or empty: the model's default), got {value!r}")
    return value


def _row_to_item(row: dict[str, Any], index: int, path: Path) -> TraceItem:
    def get(name: str, kind):
        value = row.get(name)
        return None if value in (None, "") else kind(value)

    def positive(name: str, unit: str) -> float | None:
        value = get(name, float)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{where}: {name} must be a positive number of {unit} (or empty: none), "
                             f"got {row[name]!r}")
        return value

    where = f"{path}: row {index + 1}"
    unknown = set(row) - {"offset_s", *SPEC_FIELDS, *ALIASES}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}; "
                         f"allowed: offset_s, {', '.join(SPEC_FIELDS)}, {', '.join(ALIASES)}")
    for alias, name in ALIASES.items():
        if get(alias, str) is not None:
            if get(name, str) is not None and get(alias, float) != get(name, float):
                raise ValueError(f"{where}: {alias} {row[alias]!r} and {name} {row[name]!r} disagree")
            row = {**row, name: row[alias]}
    if get("offset_s", float) is None or not get("prompt", str):
        raise ValueError(f"{where}: offset_s and prompt are required")
    seed = get("seed", int)
    timeout, slo_ms = positive("timeout_s", "seconds"), positive("slo_ms", "milliseconds")
    if timeout is None and slo_ms is not None:
        timeout = slo_ms / 1000.0  # a per-request SLO is the request's deadline
    spec = RequestSpec(prompt=get("prompt", str), seed=index if seed is None else seed,
                       num_inference_steps=get("num_inference_steps", int), guidance_scale=get("guidance_scale", float),
                       sampler=get("sampler", str), height=get("height", int), width=get("width", int),
                       negative_prompt=get("negative_prompt", str) or "", timeout_s=timeout, slo_ms=slo_ms,
                       cache=_cache_cell(row.get("cache")), loras=_loras_cell(row.get("loras")),
                       edit=_edit_cell(get("edit", str), where), strength=_strength_cell(get("strength", float), where),
                       image=get("image", int), num_frames=get("num_frames", int), control=get("control", str),
                       ip_adapter=get("ip_adapter", str), ip_image=get("ip_image", int), model=get("model", str))
    return TraceItem(get("offset_s", float), spec)
