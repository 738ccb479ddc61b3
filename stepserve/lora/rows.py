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


@contextlib.contextmanager
def every_row(adapters: Row) -> Iterator[None]:
    """Inside the block, every row of every forward on this thread carries `adapters` (the text encoders' batches
    of prompts, encoded per adapter set)."""
    before = getattr(_state, "rows", None)
    _state.rows = (None, [(position, name, None, [scale]) for position, (name, scale) in enumerate(adapters)]) \
        if adapters else None
    try:
        yield
    finally:
        _state.rows = before


def _groups(rows: Sequence[Row]) -> tuple[int, list[tuple[int, str, list[int], list[float]]]]:
    """(batch rows, [(position, adapter, row indices, scales)]) in order of the adapter's position within its rows'
    lists, so that each row adds its adapters in its own order (as diffusers sums the active adapters)."""
    groups: dict[tuple[int, str], tuple[list[int], list[float]]] = {}
    for i, row in enumerate(rows):
        for position, (name, scale) in enumerate(row):
            at, scales = groups.setdefault((position, name), ([], []))
            at.append(i)
            scales.append(float(scale))
    return len(rows), [(position, name, at, scales)
                       for (position, name), (at, scales) in sorted(groups.items(), key=lambda kv: kv[0][0])]


def hook(module, args, output):
    """Forward hook of a PEFT LoRA layer whose own adapter application is switched off."""
    state = getattr(_state, "rows", None)
    if state is None:
        return output
    n, groups = state
    x = args[0]
    if n is None:  # every row (every_row): one matmul pair per adapter over the whole batch
        n = x.shape[0]
        groups = [(position, name, list(range(n)), scales * n) for position, name, _, scales in groups]
    if x.shape[0] != n:  # a call whose leading dimension is not the batch rows (none in the served families)
        raise RuntimeError(f"LoRA rows: {type(module).__name__} got a leading dimension {x.shape[0]}, "
                           f"expected {n} batch rows")
    if x.dim() == 3 and isinstance(module.base_layer, torch.nn.Linear) and _mixed(groups):
        return _gathered(module, x, output, n, groups)
    # One adapter per position (a request alone, or batch-mates that share theirs), or a layer that is not a
    # Linear on (rows, tokens, features): one matmul pair per adapter, the operations diffusers runs.
    for _, name, at, scales in groups:
        if name not in module.lora_A:
            continue
        A, B = module.lora_A[name], module.lora_B[name]
        index = None if len(at) == n else torch.tensor(at, dtype=torch.long, device=x.device)
        xs = x if index is None else x.index_select(0, index)
        # float32 factors, each product rounded once, as peft multiplies by the Python float (not 0.7 as 0.6992)
        factor = torch.tensor([module.scaling[name] * s for s in scales], dtype=torch.float32, device=x.device)
        delta = (B(A(xs.to(A.weight.dtype))) * factor.view(-1, *([1] * (output.dim() - 1)))).to(output.dtype)
        output = output + delta if index is None else output.index_add(0, index, delta.to(output.dtype))
    return output


def _mixed(groups) -> bool:
    """Whether rows at one position of their adapter lists carry different adapters."""
    seen: dict[int, str] = {}
    for position, name, _, _ in groups:
        if seen.setdefault(position, name) != name:
            return True
    return False


def _gathered(module, x, output, n: int, groups):
    """Linear layers on (rows, tokens, features): each row gathers its own A and B from the layer's stack of the
    adapters of its adapter's rank, two batched matmuls per (adapter position in the rows' lists, rank) whatever the
    number of adapters (Punica's gather over S-LoRA's stacked layout). A stack per rank holds exactly its adapters'
    weights (no padding to the largest rank), so it takes what the store counts for it (`stack_bytes`)."""
    stacks = _stacks(module, x.device)
    for position in sorted({g[0] for g in groups}):
        by_rank: dict[int, tuple[list[int], list[int], list[float]]] = {}
        for p, name, at, sc in groups:
            if p == position and name in module.lora_A:  # rows whose adapter skips this layer add nothing here
                rank = int(module.r[name])
                names = stacks[rank][0]
                rows, ids, scales = by_rank.setdefault(rank, ([], [], []))
                rows += at
                ids += [names.index(name)] * len(at)
                scales += sc
        for rank, (rows, ids, scales) in by_rank.items():
            _, A, B, scaling = stacks[rank]
            order = sorted(range(len(rows)), key=rows.__getitem__)
            rows = [rows[i] for i in order]
            ids_t = torch.tensor([ids[i] for i in order], dtype=torch.long, device=x.device)
            factor = (scaling.index_select(0, ids_t)  # float32, as above
                      * torch.tensor([scales[i] for i in order], dtype=torch.float32, device=x.device))
            index = None if len(rows) == n else torch.tensor(rows, dtype=torch.long, device=x.device)
            xs = x if index is None else x.index_select(0, index)
            xa = torch.bmm(xs.to(A.dtype), A.index_select(0, ids_t).transpose(1, 2))
            delta = (torch.bmm(xa, B.index_select(0, ids_t).transpose(1, 2)) * factor.view(-1, 1, 1)).to(output.dtype)
            output = output + delta if index is None else output.index_add(0, index, delta)
    return output


def _stacks(module, device) -> dict[int, tuple[list[str], torch.Tensor, torch.Tensor, torch.Tensor]]:
    """This layer's stacks by rank: rank -> (names, A: adapters x rank x in, B: adapters x out x rank, scaling),
    built on first use and kept on the layer until an adapter of it is loaded or deleted (`drop_stacks`)."""
    names = tuple(module.lora_A.keys())
    cached = getattr(module, "_stepserve_stacks", None)
    if cached is not None and cached[0] == names:
        return cached[1]
    module._stepserve_stacks = None  # the old stacks go before the new ones are built
    base = module.base_layer
    dtype = base.weight.dtype
    stacks = {}
    for rank in sorted({int(module.r[nm]) for nm in names}):
        at = [nm for nm in names if int(module.r[nm]) == rank]
        with torch.no_grad():
            A = torch.stack([module.lora_A[nm].weight.to(device, dtype) for nm in at])
            B = torch.stack([module.lora_B[nm].weight.to(device, dtype) for nm in at])
        # the factors stay float32: each product is rounded once to the output's dtype (_gathered)
        scaling = torch.tensor([module.scaling[nm] for nm in at], dtype=torch.float32, device=device)
        stacks[rank] = (at, A, B, scaling)
    module._stepserve_stacks = (names, stacks)
    return stacks


def stack_bytes(layers, key: str) -> int:
    """What adapter `key` adds to the stacks of `layers` (its slots: its weights in each Linear layer's dtype, its
    scaling in float32)."""
    total = 0
    for layer in layers:
        base = getattr(layer, "base_layer", None)
        if isinstance(base, torch.nn.Linear) and key in layer.lora_A:
            r = int(layer.r[key])
            total += r * (base.in_features + base.out_features) * base.weight.element_size() + 4
    return total


def drop_stacks(layers) -> None:
    """Free the stacks of `layers` (an adapter of theirs is loaded or deleted: they are rebuilt on next use)."""
    for layer in layers:
        if getattr(layer, "_stepserve_stacks", None) is not None:
            layer._stepserve_stacks = None


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
    for position, name, rows, scales in groups:
        kept = [(where[i], s) for i, s in zip(rows, scales) if i in where]
        if kept:
            narrowed.append((position, name, [k for k, _ in kept], [s for _, s in kept]))
    _state.rows = (len(at), narrowed)
    try:
        yield
    finally:
        _state.rows = state
