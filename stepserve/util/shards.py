"""A transformer's sequence shards, when diffusers' context-parallel hooks split it over ranks (--ulysses-degree;
stepserve/parallel/split.py applies them): what our own code beside the hooks needs to cut a tensor as the model's
plan cuts its inputs, and to make every rank take the same decision.

The hooks split only the inputs their plan names, at the modules it names. Code that reimplements a forward (the
step caches, stepserve/caching) or hands a transformer tensors the plan does not know (ControlNet residuals, added
to the image tokens after blocks that run on a shard) cuts them here, the same way (diffusers'
EquipartitionSharder: `chunk` over the sequence ranks, this rank's piece). Without a split every function here is
the identity, so the one-device path runs exactly as before."""

from __future__ import annotations

import torch


def _mesh(module):
    """The device mesh of `module`'s sequence ranks (None: not split over a sequence)."""
    config = getattr(module, "_parallel_config", None)  # ModelMixin.enable_parallelism's
    context = getattr(config, "context_parallel_config", None)
    return getattr(context, "_flattened_mesh", None)


def sequence_degree(module) -> int:
    """How many ranks split `module`'s token sequence (1: it runs whole here)."""
    mesh = _mesh(module)
    return 1 if mesh is None else mesh.size()


def shard(x: torch.Tensor | None, dim: int, module) -> torch.Tensor | None:
    """This rank's piece of `x` along `dim`, as `module`'s plan cuts its inputs (None stays None)."""
    mesh = _mesh(module)
    if x is None or mesh is None:
        return x
    import torch.distributed as dist

    if x.shape[dim] % mesh.size():
        raise ValueError(f"{x.shape[dim]} tokens do not split over {mesh.size()} sequence ranks")
    return x.chunk(mesh.size(), dim=dim)[dist.get_rank(mesh.get_group())]


def sum_over_ranks(x: torch.Tensor, module) -> torch.Tensor:
    """`x` summed over `module`'s sequence ranks (every rank gets the same values back); `x` itself without a
    split."""
    mesh = _mesh(module)
    if mesh is None:
        return x
    import torch.distributed as dist

    x = x.contiguous().clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return x


def shard_residuals(controls: dict, module) -> dict:
    """ControlNet outputs as `module`'s blocks take them on this rank: each residual (rows, tokens, width) cut to
    this rank's image tokens. A ControlNet runs whole (diffusers has no plan for it), while the transformer blocks
    it adds to run on a shard."""
    if _mesh(module) is None:
        return controls
    return {k: tuple(shard(x, 1, module) for x in v) if isinstance(v, (tuple, list)) else v
            for k, v in controls.items()}
