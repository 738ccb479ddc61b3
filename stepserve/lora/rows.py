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
_generation = [0]  # bumped at every adapter load or delete: per-layer stacks are rebuilt after one


def bump_generation() -> None:
    _generation[0] += 1


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
        factor = torch.tensor([module.scaling[name] * s for s in scales], dtype=output.dtype, device=x.device)
        delta = B(A(xs.to(A.weight.dtype))) * factor.view(-1, *([1] * (output.dim() - 1)))
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
    """Linear layers on (rows, tokens, features): each row gathers its own A and B from the layer's stack of every
    adapter it holds (a zero slot for adapters it does not), two batched matmuls per adapter position in the rows'
    lists whatever the number of adapters (Punica's gather over S-LoRA's stacked layout)."""
    stack = getattr(module, "_stepserve_stack", None)
    names = tuple(module.lora_A.keys())
    if stack is None or stack[0] != (names, _generation[0]):  # rebuilt after an adapter is loaded or deleted
        stack = ((names, _generation[0]), *_stack(module, names, x.device))
        module._stepserve_stack = stack
    _, A, B, scaling = stack
    where = {name: i for i, name in enumerate(names)}
    zero = len(names)  # the zero slot
    for position in sorted({g[0] for g in groups}):
        rows, ids, scales = [], [], []
        for p, name, at, sc in groups:
            if p == position:
                rows += at
                ids += [where.get(name, zero)] * len(at)
                scales += sc
        order = sorted(range(len(rows)), key=rows.__getitem__)
        rows = [rows[i] for i in order]
        ids_t = torch.tensor([ids[i] for i in order], dtype=torch.long, device=x.device)
        factor = (scaling.index_select(0, ids_t)
                  * torch.tensor([scales[i] for i in order], dtype=scaling.dtype, device=x.device))
        index = None if len(rows) == n else torch.tensor(rows, dtype=torch.long, device=x.device)
        xs = x if index is None else x.index_select(0, index)
        xa = torch.bmm(xs.to(A.dtype), A.index_select(0, ids_t).transpose(1, 2))
        delta = (torch.bmm(xa, B.index_select(0, ids_t).transpose(1, 2)) * factor.view(-1, 1, 1)).to(output.dtype)
        output = output + delta if index is None else output.index_add(0, index, delta)
    return output


def _stack(module, names: tuple[str, ...], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A: (adapters + 1) x r_max x in, B: (adapters + 1) x out x r_max, scaling: adapters + 1) of this layer's
    adapters, zero-padded to the largest rank, and a last all-zero slot."""
    base = module.base_layer
    r_max = max((module.r[nm] for nm in names), default=1)
    dtype = base.weight.dtype
    A = torch.zeros(len(names) + 1, r_max, base.in_features, dtype=dtype, device=device)
    B = torch.zeros(len(names) + 1, base.out_features, r_max, dtype=dtype, device=device)
    scaling = torch.zeros(len(names) + 1, dtype=dtype, device=device)
    with torch.no_grad():
        for i, nm in enumerate(names):
            r = module.r[nm]
            A[i, :r] = module.lora_A[nm].weight
            B[i, :, :r] = module.lora_B[nm].weight
            scaling[i] = module.scaling[nm]
    return A, B, scaling


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
