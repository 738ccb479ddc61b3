"""A request's image embedding computed once (at its first step, with the requests admitted beside it), and the
UNet's IP-Adapter for the forwards that have image-prompt rows.

diffusers' IP attention adds `scale * attention(query, to_k_ip(tokens), to_v_ip(tokens))` to each cross-attention
with one float scale for the batch. Attention is linear in its values, so scaling each row's `to_v_ip` output by the
row's scale (RowScaled) gives each row its own scale in the same forward: a row without an image prompt has scale 0
and a zero embedding, its image attention is exactly zero and its output the plain model's. With classifier-free
guidance a request's unconditional row takes the zero embedding at the request's scale, as diffusers'
`prepare_ip_adapter_image_embeds` makes it.

Rows of different adapters share the forward: the UNet gets the adapters of the forward's rows together (the store's
`joined`), and each adapter's image attention is scaled per row by that row's scale for it, 0 for the rows of other
adapters (with a zero embedding), so every row gets exactly its own adapter's term.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_state = threading.local()


@dataclass
class Embedded:
    """A request's image prompt ready for the steps: the adapter's name, its scale and the image's embedding."""

    name: str
    scale: float
    embeds: Tensor  # (1, D): the image encoder's image_embeds for the request's image


class RowScaled(torch.nn.Module):
    """An IP processor's to_v_ip for adapter `name`, each batch row's output times its row's scale for that adapter
    (set for the forward by `applied`)."""

    def __init__(self, linear: torch.nn.Module, name: str) -> None:
        super().__init__()
        self.linear, self.name = linear, name

    def forward(self, x: Tensor) -> Tensor:
        scales = getattr(_state, "scales", None)
        scales = None if scales is None else scales.get(self.name)
        if scales is None or scales.shape[0] != x.shape[0]:
            raise RuntimeError(f"IP-Adapter rows: {x.shape[0]} rows, scales for "
                               f"{None if scales is None else scales.shape[0]}")
        out = self.linear(x)  # scales stay float32: each product rounded once, as diffusers' `scale * ...`
        return (out * scales.view(-1, *([1] * (out.dim() - 1)))).to(out.dtype)


@torch.no_grad()
def embed(loaded, images: Sequence) -> Tensor:
    """The image encoder's image_embeds (N, D) for `images` (PIL), one encoder pass, as diffusers' encode_image
    prepares each picture (the adapter's CLIPImageProcessor)."""
    pixels = loaded.features(list(images), return_tensors="pt").pixel_values
    param = next(loaded.encoder.parameters())
    return loaded.encoder(pixels.to(param.device, param.dtype)).image_embeds


def prepare(store, requests: list) -> None:
    """Set each request's `image_prompt` (a tuple of Embedded, one per adapter in the request's order; None without
    an image prompt). The adapters of these requests are loaded together (none unloads another of them); the images
    of one adapter are encoded in one pass. Raises what store.ensure raises (the engine then runs the requests
    alone, failing only the one that cannot have its adapters)."""
    prompts = [getattr(r.params, "ip_adapter", None) or () for r in requests]
    names = list(dict.fromkeys(p.name for ps in prompts for p in ps))
    if not names:
        return
    with store.starting(names):  # a load elsewhere (the front end's) unloads none of them meanwhile
        loaded = {name: store.ensure(name, keep=names) for name in names}
        embedded: dict[tuple[int, str], Embedded] = {}
        for name in names:
            at = [(i, p) for i, ps in enumerate(prompts) for p in ps if p.name == name]
            embeds = embed(loaded[name], [p.image for _, p in at])
            for j, (i, p) in enumerate(at):
                embedded[i, name] = Embedded(name, p.scale, embeds[j:j + 1])
        with store.mutex:
            gone = [n for n in names if store.loaded.get(n) is not loaded[n]]
            if gone:  # unloaded meanwhile (by an unload this store does not foresee)
                raise LookupError(f"IP-Adapter(s) {', '.join(map(repr, gone))} were unloaded while these requests "
                                  f"started (--ip-adapter-memory-mb); retry later")
            for i, ps in enumerate(prompts):
                if ps:
                    requests[i].image_prompt = tuple(embedded[i, p.name] for p in ps)
                    store.hold(requests[i])


@contextlib.contextmanager
def applied(store, unet, rows: Sequence[tuple[tuple[Embedded, ...] | None, bool]]) -> Iterator[dict]:
    """For the forward inside the block: the adapters in the UNet and the UNet's keywords for `rows` (one per batch
    row: the request's tuple of Embedded or None, and whether the row is the request's conditional one). Yields {}
    when no row has an image prompt (the plain UNet runs). Raises LookupError when a row's adapter is no longer
    loaded."""
    if not any(es for es, _ in rows):  # every step without image prompts: nothing to build
        yield {}
        return
    by_row = [({e.name: e for e in es} if es else {}, cond) for es, cond in rows]
    names = tuple(sorted({name for es, _ in by_row for name in es}))
    try:
        processors, projection = store.joined(names)
    except KeyError:
        missing = sorted(set(names) - set(store.loaded))
        raise LookupError(f"IP-Adapter(s) {', '.join(missing)} no longer loaded; retry later") from None
    embeds, scales = [], {}
    for name in names:
        like = next(es[name].embeds for es, _ in by_row if name in es)
        zero = torch.zeros_like(like)
        embeds.append(torch.cat([es[name].embeds if name in es and cond else zero for es, cond in by_row])[:, None])
        scales[name] = torch.tensor([es[name].scale if name in es else 0.0 for es, _ in by_row],
                                    dtype=torch.float32, device=like.device)
    kind, own = unet.config.encoder_hid_dim_type, unet.encoder_hid_proj  # the UNet's own, put back after
    before = getattr(_state, "scales", None)
    store.use(processors)
    unet.encoder_hid_proj, unet.config.encoder_hid_dim_type = projection, "ip_image_proj"
    _state.scales = scales
    try:
        yield {"added_cond_kwargs": {"image_embeds": embeds}}
    finally:
        _state.scales = before
        store.use(store.plain)
        unet.encoder_hid_proj, unet.config.encoder_hid_dim_type = own, kind


@contextlib.contextmanager
def rows_subset(at: Sequence[int]) -> Iterator[None]:
    """Inside the block, the forward runs on the batch rows `at` only (step caching's deep part): the scales follow
    their rows."""
    scales = getattr(_state, "scales", None)
    if scales is None:
        yield
        return
    index = torch.tensor(list(at), dtype=torch.long, device=next(iter(scales.values())).device)
    _state.scales = {name: rows.index_select(0, index) for name, rows in scales.items()}
    try:
        yield
    finally:
        _state.scales = scales
