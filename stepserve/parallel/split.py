"""The split of one forward over the ranks, applied on every rank after its pipeline loads (same calls, same order).

Ranks are laid out CFG-outermost: rank = c * inner + i, where c in {0, 1} is the CFG half (0: the conditional
rows, 1: the unconditional rows; always 0 without --cfg-parallel) and i the rank among the `inner` ranks that split
the transformer (sequence or tensor parallel) and run the same rows.

- Sequence and tensor parallel are diffusers' own hooks (`ModelMixin.enable_parallelism`), applied to the family's
  transformer (and Wan 2.2's second expert) over the inner ranks; the transformer's output comes back whole on
  every one of them. What our code hands a split transformer beside its plan is cut in stepserve/util/shards.py.
- CFG parallel is ours (diffusers has none): `Split.rows` says which of a step's rows this rank runs (a request's
  conditional row always on CFG half 0, its unconditional row on half 1, so what a row caches between steps stays on
  the rank that made it), and `Split.gather` puts the two halves' outputs back in row order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .degrees import Degrees


@dataclass
class Split:
    degrees: Degrees
    rank: int
    cfg_group: Any = None  # the 2 ranks that hold one row's two halves (None without --cfg-parallel)
    inner_group: Any = None  # the ranks that split one forward (None when there are none)

    @property
    def inner(self) -> int:
        return self.degrees.sequence * self.degrees.tensor

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.inner if self.degrees.cfg else 0

    def rows(self, conditional: int, total: int) -> range:
        """Of a step's `total` rows, the first `conditional` of which are conditional: the ones this rank runs."""
        if not self.degrees.cfg:
            return range(total)
        return range(0, conditional) if self.cfg_rank == 0 else range(conditional, total)

    def gather(self, mine: torch.Tensor | None, conditional: int, total: int, like: torch.Tensor) -> torch.Tensor:
        """Every row's output in row order, from each CFG half's `mine` (None: this half had no row). `like`: a
        tensor shaped as one row's output (rows, ...), in the networks' dtype (what they return, so that guidance
        runs in the dtype it runs in on one device), gives the shape and dtype of a missing half."""
        if not self.degrees.cfg:
            return mine
        sizes = (conditional, total - conditional)
        longest = max(sizes)
        padded = torch.zeros((longest, *like.shape[1:]), dtype=like.dtype, device=like.device)
        if mine is not None and mine.shape[0]:
            padded[: mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in range(2)]
        dist.all_gather(parts, padded, group=self.cfg_group)
        return torch.cat([parts[0][: sizes[0]], parts[1][: sizes[1]]])


def allow_cpu_context_parallel() -> None:
    """diffusers places each rank on `rank % torch.accelerator.device_count()`; a CPU-only torch answers 0 there (no
    accelerator), so on the CPU one device is what every rank shares."""
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1


def apply_split(pipeline, degrees: Degrees) -> Split:
    """Make the process groups (every rank, same order) and split the family's transformer as `degrees` say.
    torch.distributed must be initialised over degrees.world ranks."""
    rank, inner = dist.get_rank(), degrees.sequence * degrees.tensor
    split = Split(degrees, rank)
    if degrees.cfg:
        for i in range(inner):  # every rank makes every group
            group = dist.new_group([i, inner + i])
            if rank % inner == i:
                split.cfg_group = group
    if inner > 1:
        split.inner_group = _split_transformer(pipeline, degrees, rank, inner)
    return split


def _split_transformer(pipeline, degrees: Degrees, rank: int, inner: int):
    from diffusers import ContextParallelConfig, TensorParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    # the family's transformer, and Wan 2.2's low-noise expert beside it (a step's rows may run on either)
    transformers = [t for t in (pipeline.networks.transformer, getattr(pipeline.networks, "transformer_2", None))
                    if t is not None]
    device_type = "cuda" if pipeline.device.type == "cuda" else "cpu"
    if device_type == "cpu":
        allow_cpu_context_parallel()
    halves = 2 if degrees.cfg else 1
    if degrees.sequence > 1:
        mesh = init_device_mesh(device_type, (halves, degrees.ring, degrees.ulysses),
                                mesh_dim_names=("cfg", "ring", "ulysses"))
    else:
        mesh = init_device_mesh(device_type, (halves, degrees.tensor), mesh_dim_names=("cfg", "tp"))
    for transformer in transformers:  # a config each: diffusers keeps per-model state in it
        if degrees.sequence > 1:
            config = ContextParallelConfig(ulysses_degree=degrees.ulysses, ring_degree=degrees.ring,
                                           mesh=mesh["ring", "ulysses"])
            if degrees.ring > 1:  # ring attention merges partial results by their log-sum-exp: flash or cuDNN
                transformer.set_attention_backend("flash" if _has_flash() else "_native_cudnn")
        else:
            config = TensorParallelConfig(tp_degree=degrees.tensor, mesh=mesh["tp"])
        transformer.enable_parallelism(config=config)
    return mesh


def _has_flash() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None
