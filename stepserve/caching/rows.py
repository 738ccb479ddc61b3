"""Per-row cache state and the per-row decisions (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .spec import CacheSpec

Request = Any  # stepserve.request.types.Request (whose module imports this package's spec)


@dataclass
class RowState:
    """A request's step-caching state: tensors per branch ("cond", "uncond"), kept until the request ends."""

    spec: CacheSpec
    branches: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    schedule: list[bool] | None = None  # magcache: compute (True) or skip, per step, fixed at the start

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self.branches.values() for t in b.values())


@dataclass
class RowCache:
    """One row of a step's forward that caches: its request's spec, the branch's tensors (updated in place by the
    forward), and where the request stands."""

    spec: CacheSpec
    tensors: dict[str, Tensor]
    step: int
    schedule: list[bool] | None = None
    skipped: bool = False  # set by the forward: this row reused cached work at this step


def row_caches(requests: list[Request], guided: list[int]) -> list[RowCache | None] | None:
    """The step's rows (each request's conditional row, then the unconditional row of each guided request, as the
    executor lays them out): a RowCache for each row whose request caches, None for the others; None when no row
    caches (the plain forward runs)."""
    if not any(r.params.cache is not None for r in requests):
        return None

    def row(r: Request, branch: str) -> RowCache | None:
        spec = r.params.cache
        if spec is None:
            return None
        if r.step_cache is None:
            r.step_cache = RowState(spec, schedule=_schedule(spec, r.num_inference_steps))
        state = r.step_cache
        return RowCache(spec, state.branches.setdefault(branch, {}), r.step, state.schedule)

    return [row(r, "cond") for r in requests] + [row(requests[i], "uncond") for i in guided]


def _schedule(spec: CacheSpec, num_steps: int) -> list[bool] | None:
    if spec.policy == "magcache":
        from .magcache import magcache_schedule

        return magcache_schedule(spec, num_steps)
    return None


def reuses_before(row: RowCache | None, have: str) -> bool:
    """Whether the row reuses cached work at this step, known before the forward: deepcache's interval and
    magcache's schedule decide it by the step (fbcache decides on the first block's output, inside the forward).
    `have`: the cached tensor a reuse needs."""
    if row is None or have not in row.tensors:
        return False
    if row.spec.policy == "deepcache":
        return row.step % row.spec.interval != 0
    if row.spec.policy == "magcache":
        return not (row.schedule[row.step] if row.step < len(row.schedule) else True)
    return False


def must_compute(rows: list[RowCache | None], signal: Tensor | None, have: str,
                 over_ranks: Callable[[Tensor], Tensor] | None = None) -> list[bool]:
    """Per row: whether it runs the expensive part at this step. `signal`: the rows' first-block residual (fbcache
    compares it with the one of the row's last full step); `have`: the cached tensor a skip needs. `over_ranks`:
    with the tokens split over sequence ranks, `signal` is this rank's shard: the function sums a tensor over the
    ranks, so that every rank takes the same decision, the one the whole residual gives (equal shards: the sum
    of the shards' means over the sum of theirs is the ratio of the whole row's means)."""
    out: list[bool | None] = []
    parts: list[Tensor] = []
    for i, row in enumerate(rows):
        if row is None or have not in row.tensors:
            out.append(True)
        elif row.spec.policy in ("deepcache", "magcache"):
            out.append(not reuses_before(row, have))
        else:  # fbcache: as diffusers' FBCHeadBlockHook, a ratio of means over the row, in the model's dtype
            prev = row.tensors["ref"]
            parts.append(torch.stack([(signal[i:i + 1] - prev).abs().mean(), prev.abs().mean()]))
            out.append(None)
    if parts:
        means = torch.stack(parts)
        if over_ranks is not None:
            means = over_ranks(means)
        values = iter((means[:, 0] / means[:, 1]).tolist())  # one host sync for the whole batch
        out = [next(values) > rows[i].spec.threshold if c is None else c for i, c in enumerate(out)]
    return [bool(c) for c in out]


def index_of(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.int64, device=device)


def gather(x: Tensor | None, at: Tensor | None) -> Tensor | None:
    """The rows `at` of `x` (None: all of them; an absent input stays None): the transformer forwards' one
    gather."""
    return x if x is None or at is None else x.index_select(0, at)
