"""A QwenImageTransformer2DModel forward with First-Block Cache per row (fbcache; see the package docstring).

The forward of diffusers 0.42's QwenImageTransformer2DModel (no `zero_cond_t`, no attention kwargs; ControlNet
outputs added after the blocks as it adds them), with the decision of diffusers' FirstBlockCache hooks taken per
row instead of per call: the first block runs for every row; its residual on the image stream (output - input) is
compared with the one of the row's last full step, mean |r - r_prev| / mean |r_prev|; at most `threshold` skips
the other blocks, whose output is then the first block's output plus the residual of the other blocks cached at
that step (last block's output - first block's output). norm_out and proj_out always run, with the step's own time
embedding. With every row computing it is the same sequence of operations as the model's forward (a test checks
equality). Split over sequence ranks, diffusers' hooks on the blocks cut the tokens (this forward calls the blocks,
whose hooks run); the decision is taken on the whole residual, reduced over the ranks, so every rank skips the same
rows.

MagCache is not served on this family: its magnitude ratios are calibrated per model, and diffusers ships
Flux's only."""

from __future__ import annotations

import torch
from torch import Tensor

from ..lora.rows import rows_subset
from ..util.shards import shard, sum_over_ranks
from .flux import _control
from .rows import RowCache, gather, index_of, must_compute


@torch.no_grad()
def qwenimage_forward(tr, hidden_states: Tensor, timestep: Tensor, *, encoder_hidden_states: Tensor,
                      img_shapes: list, encoder_hidden_states_mask: Tensor | None,
                      rows: list[RowCache | None], controlnet_block_samples=None) -> Tensor:
    """The transformer's prediction for every row; `rows[i]` says how row i caches (None: it does not);
    `controlnet_block_samples`: the rows' ControlNet outputs (stepserve/controls), as the transformer takes them."""
    from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

    if getattr(tr, "zero_cond_t", False):
        raise ValueError("fbcache: a Qwen-Image transformer with zero_cond_t (editing) is not served")
    hs0 = tr.img_in(hidden_states)
    timestep = timestep.to(hs0.dtype)
    ehs0 = tr.txt_in(tr.txt_norm(encoder_hidden_states))
    text_seq_len, _, mask = compute_text_seq_len_from_mask(ehs0, encoder_hidden_states_mask)
    temb = tr.time_text_embed(timestep, hs0, None)
    rotary = tr.pos_embed(img_shapes, max_txt_seq_len=text_seq_len, device=hs0.device)
    n, count = hs0.shape[0], len(tr.transformer_blocks)
    controls = [shard(x, 1, tr) for x in controlnet_block_samples or ()]  # added to the blocks' shards

    def run(blocks, at: Tensor | None, hs: Tensor, ehs: Tensor, row_ids: list[int],
            first: int = 0) -> tuple[Tensor, Tensor]:
        samples = [gather(x, at) for x in controls]
        with rows_subset(row_ids):  # LoRA adapters (stepserve/lora) follow their rows
            for k, block in enumerate(blocks, start=first):
                # every input named, modulate_index too, as the model's forward names them: the sequence-parallel
                # hooks on the blocks look the inputs of their plan up by name
                ehs, hs = block(hidden_states=hs, encoder_hidden_states=ehs,
                                encoder_hidden_states_mask=gather(mask, at), temb=gather(temb, at),
                                image_rotary_emb=rotary, modulate_index=None)
                hs = _control(hs, samples, count, k)
        return hs, ehs

    hs1, ehs1 = run(tr.transformer_blocks[:1], None, hs0, ehs0, list(range(n)))
    # split over sequence ranks (--ulysses-degree), the first block's hook cut its inputs to this rank's tokens
    # (QwenImageTransformer2DModel._cp_plan): its residual is taken on the same shard, and decided on over the ranks
    signal = hs1 - shard(hs0, 1, tr)
    go_on = must_compute(rows, signal, "tail", lambda x: sum_over_ranks(x, tr))
    tail = [i for i in range(n) if go_on[i]]
    hs_t = None
    if tail:
        at = None if len(tail) == n else index_of(tail, hs0.device)
        hs_t, _ = run(tr.transformer_blocks[1:], at, gather(hs1, at), gather(ehs1, at), tail, first=1)
    if len(tail) == n:
        out_hs = hs_t
    else:
        parts: list[Tensor] = [None] * n  # type: ignore[list-item]
        for j, i in enumerate(tail):
            parts[i] = hs_t[j:j + 1]
        for i in range(n):
            if parts[i] is None:  # a skip: the first block's output plus the cached residual of the rest
                parts[i] = hs1[i:i + 1] + rows[i].tensors["tail"]
                rows[i].skipped = True
        out_hs = torch.cat(parts)
    for j, i in enumerate(tail):  # what the rows that computed keep for their next steps
        if rows[i] is not None:
            rows[i].tensors["tail"] = (hs_t[j:j + 1] - hs1[i:i + 1]).clone()
            rows[i].tensors["ref"] = signal[i:i + 1].clone()
    return tr.proj_out(tr.norm_out(out_hs, temb))
