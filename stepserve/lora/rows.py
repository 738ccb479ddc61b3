"""The per-row application of LoRA adapters inside one forward (see the package docstring).

`adapter_rows(rows)` sets, for the duration of one forward, which adapters each row of the batch carries: rows[i]
is a tuple of (adapter name, scale) in the request's order (empty: a plain row). The hook on every adapted layer
adds, for each row, sum over its adapters of scale * scaling[name] * B(A(x_row)), in the row's own order, the rows
that share (position, adapter) in one matmul. Without a context (or with no adapter in the batch) the layers run
their base weights only."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

Row = tuple[tuple[str, float], ...]
_state = threading.local()


@contextlib.contextmanager
def adapter_rows(rows: Sequence[Row] | None) -> Iterator[None]:
    """Inside the block, forwards on this thread apply `rows` (one entry per batch row)."""
    before = getattr(_state, "rows", None)
    _state.rows = _groups(rows) if rows is not None and any(rows) else None
    try:
        yield
    finally:
        _state.rows = before


def _groups(rows: Sequence[Row]) -> tuple[int, list[tuple[str, list[int], list[float]]]]:
    """(batch rows, [(adapter, row indices, scales)]) in order of position within the rows' adapter lists, so that
    each row adds its adapters in its own order (as diffusers sums the active adapters)."""
    groups: dict[tuple[int, str], tuple[list[int], list[float]]] = {}
    for i, row in enumerate(rows):
        for position, (name, scale) in enumerate(row):
            at, scales = groups.setdefault((position, name), ([], []))
            at.append(i)
            scales.append(float(scale))
    return len(rows), [(name, at, scales) for (_, name), (at, scales) in sorted(groups.items(),
                                                                                key=lambda kv: kv[0][0])]


def hook(module, args, output):
    """Forward hook of a PEFT LoRA layer whose own adapter application is switched off."""
    state = getattr(_state, "rows", None)
    if state is None:
        return output
    n, groups = state
    x = args[0]
    if x.shape[0] != n:  # a call whose leading dimension is not the batch rows (none in the served families)
        raise RuntimeError(f"LoRA rows: {type(module).__name__} got a leading dimension {x.shape[0]}, "
                           f"expected {n} batch rows")
    for name, at, scales in groups:
        if name not in module.lora_A:
            continue
        A, B = module.lora_A[name], module.lora_B[name]
        index = None if len(at) == n else torch.tensor(at, dtype=torch.long, device=x.device)
        xs = x if index is None else x.index_select(0, index)
        factor = torch.tensor([module.scaling[name] * s for s in scales], dtype=output.dtype, device=x.device)
        delta = B(A(xs.to(A.weight.dtype))) * factor.view(-1, *([1] * (output.dim() - 1)))
        if index is None:
            output = output + delta.to(output.dtype)
        else:
            output = output.index_add(0, index, delta.to(output.dtype))
    return output


@contextlib.contextmanager
def rows_subset(at: Sequence[int]) -> Iterator[None]:
    """Inside the block, the forward runs on the batch rows `at` only (step caching gathers the rows that must run
    the deep part): the adapters follow their rows."""
    state = getattr(_state, "rows", None)
    if state is None:
        yield
        return
    _, groups = state
    where = {row: k for k, row in enumerate(at)}
    narrowed = []
    for name, rows, scales in groups:
        kept = [(where[i], s) for i, s in zip(rows, scales) if i in where]
        if kept:
            narrowed.append((name, [k for k, _ in kept], [s for _, s in kept]))
    _state.rows = (len(at), narrowed)
    try:
        yield
    finally:
        _state.rows = state
