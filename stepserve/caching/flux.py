"""A FluxTransformer2DModel forward with step caching per row (fbcache, magcache; see the package docstring).

The forward of diffusers 0.42's FluxTransformer2DModel (no ControlNet, IP-Adapter or attention kwargs), with
the decisions of diffusers' cache hooks taken per row instead of per call:
- fbcache (hooks/first_block_cache.py): the first double block runs for every fbcache row; its residual on the
  image stream (output - input) is compared with the one of the row's last full step, mean |r - r_prev| /
  mean |r_prev|; at most `threshold` skips the other blocks, whose output is then the first block's output plus
  the residual of the other blocks cached at that step (last single block's output - first block's output).
- magcache (hooks/mag_cache.py): a skipped step runs no block at all: the input to the first block plus the
  residual of every block cached at the last full step (last block's output - first block's input).
norm_out and proj_out always run, with the step's own time embedding. With every row computing it is the same
sequence of operations as the model's forward (a test checks equality). Split over sequence ranks, each rank runs
its shard of the tokens and the fbcache decision is taken on the whole residual (reduced over the ranks), so every
rank skips the same rows."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..lora.rows import rows_subset
from ..util.shards import shard, sum_over_ranks
from .rows import RowCache, gather, index_of, must_compute


def _control(hs: Tensor, samples, count: int, k: int) -> Tensor:
    """After block k of `count`, FluxTransformer2DModel adds ControlNet output k // ceil(count / len(samples))
    (stepserve/controls; zeros for rows without a control)."""
    return hs + samples[k // math.ceil(count / len(samples))] if samples else hs


def _blocks(blocks, hs: Tensor, ehs: Tensor, temb: Tensor, rotary, samples=None, count: int = 0,
            first: int = 0) -> tuple[Tensor, Tensor]:
    for k, block in enumerate(blocks, start=first):
        ehs, hs = block(hidden_states=hs, encoder_hidden_states=ehs, temb=temb, image_rotary_emb=rotary)
        hs = _control(hs, samples, count, k)
    return hs, ehs


@torch.no_grad()
def flux_forward(tr, hidden_states: Tensor, timestep: Tensor, *, encoder_hidden_states: Tensor,
                 pooled_projections: Tensor, img_ids: Tensor, txt_ids: Tensor, guidance: Tensor | None,
                 rows: list[RowCache | None], controlnet_block_samples=None,
                 controlnet_single_block_samples=None) -> Tensor:
    """The transformer's prediction for every row; `rows[i]` says how row i caches (None: it does not);
    `controlnet_*`: the rows' ControlNet outputs, as the transformer takes them."""
    # Split over sequence ranks (--ulysses-degree), the transformer's own forward has its inputs cut by the plan's
    # root hook (FluxTransformer2DModel._cp_plan[""]), which this forward bypasses: cut them here as it does, and
    # the ControlNet outputs with the image tokens; proj_out's hook gathers the prediction back whole.
    hidden_states, encoder_hidden_states = shard(hidden_states, 1, tr), shard(encoder_hidden_states, 1, tr)
    img_ids, txt_ids = shard(img_ids, 0, tr), shard(txt_ids, 0, tr)
    double = tuple(shard(x, 1, tr) for x in controlnet_block_samples or ())
    single = tuple(shard(x, 1, tr) for x in controlnet_single_block_samples or ())
    hs0 = tr.x_embedder(hidden_states)
    timestep = timestep.to(hs0.dtype) * 1000
    if guidance is not None:
        guidance = guidance.to(hs0.dtype) * 1000
        temb = tr.time_text_embed(timestep, guidance, pooled_projections)
    else:
        temb = tr.time_text_embed(timestep, pooled_projections)
    ehs0 = tr.context_embedder(encoder_hidden_states)
    rotary = tr.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    n = hs0.shape[0]

    # magcache rows that skip this step run no block at all
    whole = must_compute([r if r is not None and r.spec.policy == "magcache" else None for r in rows], None,
                         "residual")
    head_rows = [i for i in range(n) if whole[i]]
    at = None if len(head_rows) == n else index_of(head_rows, hs0.device)
    hs_in = gather(hs0, at)
    first = tr.transformer_blocks[0]
    ehs1 = hs1 = None
    if head_rows:
        with rows_subset(head_rows):  # LoRA adapters (stepserve/lora) follow their rows
            ehs1, hs1 = first(hidden_states=hs_in, encoder_hidden_states=gather(ehs0, at),
                              temb=gather(temb, at), image_rotary_emb=rotary)
        double = [gather(x, at) for x in double]
        hs1 = _control(hs1, double, len(tr.transformer_blocks), 0)

    # fbcache rows whose first-block residual barely moved skip the other blocks
    head = [rows[i] if rows[i] is not None and rows[i].spec.policy == "fbcache" else None for i in head_rows]
    signal = hs1 - hs_in if any(r is not None for r in head) else None
    go_on = must_compute(head, signal, "tail", lambda x: sum_over_ranks(x, tr)) if head_rows else []
    tail_rows = [k for k, c in enumerate(go_on) if c]  # positions within head_rows
    hs_t = ehs_t = None
    if tail_rows:
        at2 = None if len(tail_rows) == len(head_rows) else index_of(tail_rows, hs0.device)
        temb_t = gather(gather(temb, at), at2)
        with rows_subset([head_rows[k] for k in tail_rows]):
            hs_t, ehs_t = _blocks(tr.transformer_blocks[1:], gather(hs1, at2), gather(ehs1, at2), temb_t, rotary,
                                  [gather(x, at2) for x in double], len(tr.transformer_blocks), first=1)
            hs_t, ehs_t = _blocks(tr.single_transformer_blocks, hs_t, ehs_t, temb_t, rotary,
                                  [gather(gather(x, at), at2) for x in single], len(tr.single_transformer_blocks))

    if len(tail_rows) == n:
        out_hs = hs_t
    else:
        parts: list[Tensor] = [None] * n  # type: ignore[list-item]
        for j, k in enumerate(tail_rows):
            parts[head_rows[k]] = hs_t[j:j + 1]
        for k, i in enumerate(head_rows):
            if parts[i] is None:  # fbcache skip: the first block's output plus the cached residual of the rest
                parts[i] = hs1[k:k + 1] + rows[i].tensors["tail"]
                rows[i].skipped = True
        for i in range(n):
            if parts[i] is None:  # magcache skip: the input plus the cached residual of every block
                parts[i] = hs0[i:i + 1] + rows[i].tensors["residual"]
                rows[i].skipped = True
        out_hs = torch.cat(parts)
    for j, k in enumerate(tail_rows):  # what the rows that computed keep for their next steps
        row = rows[head_rows[k]]
        if row is None:
            continue
        if row.spec.policy == "fbcache":
            row.tensors["tail"] = (hs_t[j:j + 1] - hs1[k:k + 1]).clone()
            row.tensors["ref"] = signal[k:k + 1].clone()
        else:
            row.tensors["residual"] = (hs_t[j:j + 1] - hs_in[k:k + 1]).clone()
    return tr.proj_out(tr.norm_out(out_hs, temb))
