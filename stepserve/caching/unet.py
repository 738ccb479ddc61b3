"""A UNet2DConditionModel forward with step caching per row (fbcache, deepcache; see the package docstring).

The forward of diffusers 0.42's UNet2DConditionModel, split at the shallow branch (DeepCache's branch 0): the
time embedding, conv_in and the first down block run for every row; the deep part (the other down blocks, the
mid block and every up block but the last) runs only for the rows that must compute; the last up block and the
output layers run for every row, on the deep features just computed or cached at the row's last full step. With
every row computing it is the same sequence of operations as the model's own forward (a test checks equality).
ControlNet residuals are added to the skips and the mid block's output as the model's forward adds them; a row
that skips takes this step's residuals for the shallow skips, on deep features computed with those of its last
full step. Not supported (the families that cache have none of them): class labels, T2I-Adapter residuals, GLIGEN,
attention masks."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ipadapter.rows import rows_subset as image_prompt_subset
from ..lora.rows import rows_subset
from .rows import RowCache, index_of, must_compute


def supports(unet) -> bool:
    """Whether unet_forward runs this UNet as its own forward would."""
    c = unet.config
    return (c.class_embed_type is None and c.addition_embed_type in (None, "text_time")
            and not c.center_input_sample and len(unet.down_blocks) >= 2 and len(unet.up_blocks) >= 2)


def _down(block, h: Tensor, emb: Tensor, ehs: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    if getattr(block, "has_cross_attention", False):
        return block(hidden_states=h, temb=emb, encoder_hidden_states=ehs)
    return block(hidden_states=h, temb=emb)


def _up(block, h: Tensor, emb: Tensor, res: tuple[Tensor, ...], ehs: Tensor, upsample_size) -> Tensor:
    if getattr(block, "has_cross_attention", False):
        return block(hidden_states=h, temb=emb, res_hidden_states_tuple=res, encoder_hidden_states=ehs,
                     upsample_size=upsample_size)
    return block(hidden_states=h, temb=emb, res_hidden_states_tuple=res, upsample_size=upsample_size)


def _deep(unet, d: Tensor, emb: Tensor, ehs: Tensor, res: tuple[Tensor, ...], forward_upsample_size: bool,
          down_res: tuple = (), mid_res: Tensor | None = None) -> Tensor:
    """The deep part: the other down blocks, the mid block and every up block but the last (`down_res`, `mid_res`:
    the ControlNet residuals of the deep skips and of the mid block, for these rows)."""
    shallow = len(res)
    for block in unet.down_blocks[1:]:
        d, more = _down(block, d, emb, ehs)
        res += more
    if down_res:
        res = res[:shallow] + tuple(x + r for x, r in zip(res[shallow:], down_res))
    if unet.mid_block is not None:
        if getattr(unet.mid_block, "has_cross_attention", False):
            d = unet.mid_block(d, emb, encoder_hidden_states=ehs)
        else:
            d = unet.mid_block(d, emb)
    if mid_res is not None:
        d = d + mid_res
    upsample_size = None
    for block in unet.up_blocks[:-1]:
        skips, res = res[-len(block.resnets):], res[:-len(block.resnets)]
        if forward_upsample_size:
            upsample_size = res[-1].shape[2:]
        d = _up(block, d, emb, skips, ehs, upsample_size)
    return d


@torch.no_grad()
def unet_forward(unet, sample: Tensor, timestep: Tensor, encoder_hidden_states: Tensor,
                 rows: list[RowCache | None], added_cond_kwargs: dict | None = None,
                 down_block_additional_residuals: tuple = (), mid_block_additional_residual: Tensor | None = None
                 ) -> Tensor:
    """The UNet's noise prediction for every row; `rows[i]` says how row i caches (None: it does not);
    ControlNet residuals as the model's forward takes them."""
    up_factor = 2 ** unet.num_upsamplers
    forward_upsample_size = any(dim % up_factor for dim in sample.shape[-2:])
    emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep), None)
    aug = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states,
                             added_cond_kwargs=added_cond_kwargs or {})
    emb = emb + aug if aug is not None else emb
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    ehs = unet.process_encoder_hidden_states(encoder_hidden_states=encoder_hidden_states,
                                             added_cond_kwargs=added_cond_kwargs or {})
    h = unet.conv_in(sample)
    res: tuple[Tensor, ...] = (h,)
    h, more = _down(unet.down_blocks[0], h, emb, ehs)
    res += more
    deep_res = ()
    if down_block_additional_residuals:  # the shallow skips now, the deep ones in _deep (after their blocks)
        deep_res = tuple(down_block_additional_residuals[len(res):])
        # (only the shallow ones when every row with a control reuses the deep part: controls/rows.py)
        given = down_block_additional_residuals
        res = tuple(x + r for x, r in zip(res, given)) + res[len(given):]
    last = unet.up_blocks[-1]
    shallow = res[:len(last.resnets)]  # the skips the last up block takes (the full forward's first ones)

    compute = must_compute(rows, h, "deep")
    run = [i for i, c in enumerate(compute) if c]
    everyone = len(run) == len(rows)
    deep = None
    if run:
        at = None if everyone else index_of(run, h.device)

        def pick(x):  # a tensor, or the text and IP-Adapter image tokens (stepserve/ipadapter)
            if isinstance(x, tuple):
                return pick(x[0]), [pick(t) for t in x[1]]
            return x if at is None else x.index_select(0, at)

        with rows_subset(run), image_prompt_subset(run):  # LoRA adapters and image prompts follow their rows
            deep = _deep(unet, pick(h), pick(emb), pick(ehs), tuple(pick(x) for x in res), forward_upsample_size,
                         tuple(pick(x) for x in deep_res),
                         None if mid_block_additional_residual is None else pick(mid_block_additional_residual))
    if everyone:
        into_last = deep
    else:
        parts = []
        j = 0
        for i, c in enumerate(compute):
            if c:
                parts.append(deep[j:j + 1])
                j += 1
            else:
                parts.append(rows[i].tensors["deep"])
                rows[i].skipped = True
        into_last = torch.cat(parts)
    j = 0
    for i, c in enumerate(compute):  # the rows that computed keep what their next steps may reuse
        if c and rows[i] is not None:
            rows[i].tensors["deep"] = deep[j:j + 1].clone()
            if rows[i].spec.policy == "fbcache":
                rows[i].tensors["ref"] = h[i:i + 1].clone()
        j += c
    out = _up(last, into_last, emb, shallow, ehs, None)
    if unet.conv_norm_out:
        out = unet.conv_act(unet.conv_norm_out(out))
    return unet.conv_out(out)
