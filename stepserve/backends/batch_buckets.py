"""Batch buckets around a networks object (see stepserve.backends): every forward runs at one of a few fixed
batch sizes, so a compiled network (torch.compile, CUDA graphs) sees only shapes it was built for.

A call with n rows runs at the smallest bucket >= n: every tensor argument batched on dim 0 (the first argument's
row count; keyword arguments too, so a model family may pass any extra conditioning tensors) is padded with copies
of its first row, the network runs, and only the first n rows of the output are returned. A call with more rows
than the largest bucket runs in chunks of the largest bucket. Padding rows never leave this class: callers, the
sampler and the engine's metrics see the real rows only.

With `fixed_rows` (the deterministic mode) every call runs at exactly that batch size. On a fixed shape the kernels
compute a row from that row's inputs alone (tests/test_deterministic.py checks this for every network and every
position), so a request's result no longer depends on who shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16)
# Keyword arguments that are never batched even when their first dimension happens to equal the row count
# (diffusers' Flux transformer takes position ids of shape (sequence, 3)).
UNBATCHED_KWARGS = frozenset({"img_ids", "txt_ids"})


def check_batch_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    """Sorted, distinct positive batch sizes, or a ValueError that says what is allowed."""
    values = tuple(buckets)
    if not values or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in values):
        raise ValueError(f"batch buckets: expected one or more integers >= 1, got {values!r}")
    return tuple(sorted(set(values)))


def batch_buckets_up_to(rows: int) -> tuple[int, ...]:
    """Powers of two from 1 to the first one >= rows (e.g. rows 16 -> 1, 2, 4, 8, 16; rows 12 -> ..., 8, 16)."""
    if rows < 1:
        raise ValueError(f"rows: expected an integer >= 1, got {rows!r}")
    return tuple(2**k for k in range(math.ceil(math.log2(rows)) + 1))


def batch_bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds n rows, or the largest bucket when none does (the call is then chunked)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def _batched(value: Any, n: int, name: str | None = None) -> bool:
    return isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == n and name not in UNBATCHED_KWARGS


def _pad(value: Tensor, size: int) -> Tensor:
    n = value.shape[0]
    if n == size:
        return value
    return torch.cat([value, value[:1].expand(size - n, *value.shape[1:])])


def _rows(out: Any, n: int, copy: bool) -> Any:
    """The first n rows of a network output (a tensor, or a tuple/list of them)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_rows(o, n, copy) for o in out)
    if isinstance(out, Tensor) and out.dim() >= 1:
        out = out[:n]
        # CUDA-graph outputs live in the graph's memory pool and are overwritten by the next replay
        return out.clone() if copy else out.contiguous()
    return out


def _cat(parts: list[Any]) -> Any:
    first = parts[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_cat([p[i] for p in parts]) for i in range(len(first)))
    return torch.cat(parts) if isinstance(first, Tensor) else first


def run_batch_bucketed(fn: Callable[..., Any], buckets: Sequence[int], args: tuple, kwargs: dict[str, Any], *,
                 before: Callable[[], None] | None = None, copy_out: bool = False) -> Any:
    """fn(*args, **kwargs) with every batched tensor argument padded to a bucket; the real rows come back.

    The row count is the first argument's dim 0. `before` runs before every padded call (CUDA-graph step marks)."""
    n = args[0].shape[0]
    if n == 0:
        raise ValueError("a network call needs at least one row; got an empty batch")
    largest = buckets[-1]
    parts = []
    for start in range(0, n, largest):
        stop = min(start + largest, n)
        size = batch_bucket_for(stop - start, buckets)
        chunk_args = tuple(_pad(a[start:stop], size) if _batched(a, n) else a for a in args)
        chunk_kwargs = {k: _pad(v[start:stop], size) if _batched(v, n, k) else v for k, v in kwargs.items()}
        if before is not None:
            before()
        parts.append(_rows(fn(*chunk_args, **chunk_kwargs), stop - start, copy_out))
    return parts[0] if len(parts) == 1 else _cat(parts)


class BatchBucketedNetworks:
    """Wraps a networks object: denoise (and, in the deterministic mode, encode_text and decode) run at bucketed
    batch sizes, the denoiser optionally compiled.

    - `buckets`: batch sizes of the denoiser (the engine's rows: one per request plus one per guided request).
    - `fixed_rows`: deterministic mode: denoise runs at exactly `fixed_rows`, encode_text and decode at
      `fixed_other_rows` (default `fixed_rows`), chunked when a call has more rows.
    - `denoise_fn`: what runs the padded denoiser call (a torch.compile of the inner networks' denoise); default:
      the inner denoise itself.
    - `cuda_graphs`: the compiled denoiser replays CUDA graphs (torch.compile mode "reduce-overhead"): each call is
      marked as a new step, and outputs are copied out of the graph's memory pool before the next replay.
    - `channels_last`: 4-d denoiser inputs are given in channels_last memory format (for convolutions on GPUs).
    """

    def __init__(self, inner: Any, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS, *, fixed_rows: int | None = None,
                 fixed_other_rows: int | None = None, denoise_fn: Callable[..., Any] | None = None,
                 cuda_graphs: bool = False, channels_last: bool = False) -> None:
        if fixed_rows is not None:
            buckets = (fixed_rows,)
        self.batch_buckets = check_batch_buckets(buckets)
        self.fixed_rows = fixed_rows
        self.other_batch_buckets = None if fixed_rows is None else check_batch_buckets((fixed_other_rows or fixed_rows,))
        self.inner = inner
        self._denoise = denoise_fn or inner.denoise
        self.cuda_graphs = cuda_graphs
        self.channels_last = channels_last
        self.calls: dict[int, int] = {}  # padded batch size -> denoiser calls at that size (for tests and stats)

    @property
    def deterministic(self) -> bool:
        return self.fixed_rows is not None

    def denoise(self, sample: Tensor, timestep: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        before = _mark_cuda_graph_step if self.cuda_graphs else None
        n = sample.shape[0]
        for start in range(0, n, self.batch_buckets[-1]):
            size = batch_bucket_for(min(n - start, self.batch_buckets[-1]), self.batch_buckets)
            self.calls[size] = self.calls.get(size, 0) + 1
        return run_batch_bucketed(self._padded_denoise, self.batch_buckets, (sample, timestep, *args), kwargs,
                                  before=before, copy_out=self.cuda_graphs)

    def _padded_denoise(self, sample: Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.channels_last and sample.dim() == 4:  # after padding: the network sees the layout it was built for
            sample = sample.contiguous(memory_format=torch.channels_last)
        return self._denoise(sample, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        """The inner object's other methods (encode_text, decode, a family's extra encoders) and modules. In the
        deterministic mode its methods run at the fixed batch size too, when their first argument is batched."""
        if name == "inner":
            raise AttributeError(name)
        value = getattr(self.inner, name)
        if self.other_batch_buckets is None or name.startswith("_") or isinstance(value, torch.nn.Module) \
                or not callable(value):
            return value
        buckets = self.other_batch_buckets

        def fixed_shape(*args: Any, **kwargs: Any) -> Any:
            if args and isinstance(args[0], Tensor) and args[0].dim() >= 1:
                return run_batch_bucketed(value, buckets, args, kwargs)
            return value(*args, **kwargs)

        return fixed_shape


def _mark_cuda_graph_step() -> None:
    # torch.compile(mode="reduce-overhead") reuses a graph's output buffers on the next replay; marking each call
    # as a new step tells cudagraph trees that the previous outputs are no longer read from the pool.
    torch.compiler.cudagraph_mark_step_begin()
