"""Small tensor helpers shared by the per-sample samplers.

Every sampler works on a batch whose rows sit at different points of different schedules. The pattern is always
the same: look each row's scalars up in its own schedule table (``gather``), make a ``(B,)`` float32 vector, and
broadcast it against the ``(B, ...)`` latents with ``append_dims``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def append_dims(v: Tensor, ndim: int) -> Tensor:
    """Reshape a ``(B,)`` vector to ``(B, 1, ..., 1)`` with ``ndim`` dimensions in total."""
    extra = ndim - v.ndim
    if extra < 0:
        raise ValueError(f"cannot broadcast a {v.ndim}-d vector to {ndim} dimensions")
    return v.reshape(v.shape + (1,) * extra)


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without stalling the host. On CUDA it is staged in pinned memory and copied
    asynchronously: a copy from pageable memory (what ``torch.tensor(..., device="cuda")`` does) waits for the
    stream to drain, so the host would sit idle until the queued forward finished before queueing the next work."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def gather(values: Sequence[float], like: Tensor) -> Tensor:
    """Stack per-row scalars into a float32 ``(B,)`` tensor on ``like``'s device.

    Table entries are float32 values kept as Python floats, so the conversion is exact.
    """
    return to_device(torch.tensor(list(values), dtype=torch.float32), like.device)


def gather_b(values: Sequence[float], like: Tensor) -> Tensor:
    """``gather`` followed by ``append_dims`` against ``like``."""
    return append_dims(gather(values, like), like.ndim)


def per_item_noise(states: Sequence, like: Tensor, dtype: torch.dtype) -> Tensor:
    """One standard normal draw per row, each from that row's own generator.

    A row draws exactly what a one-image pipeline would draw for its request: a ``(1, *latent_shape)`` tensor of
    ``dtype`` made on the generator's device and then moved to ``like``'s device.
    """
    shape = (1,) + tuple(like.shape[1:])
    draws = []
    for st in states:
        gen = st.generator
        if gen is None:
            raise ValueError(f"sampler {st.schedule.sampler!r} needs a torch.Generator in its state; got None")
        draws.append(to_device(torch.randn(shape, generator=gen, device=gen.device, dtype=dtype), like.device))
    return torch.cat(draws, dim=0)


def dynamic_threshold(x0: Tensor, ratio: float, max_value: float) -> Tensor:
    """Dynamic thresholding of the x0 estimate (Saharia et al. 2022, "Imagen", Sec. 2.3).

    Per row: s = the ``ratio`` quantile of |x0|, clamped to [1, max_value]; x0 <- clamp(x0, -s, s) / s.
    """
    dtype = x0.dtype
    flat = x0.reshape(x0.shape[0], -1)
    if dtype not in (torch.float32, torch.float64):
        flat = flat.float()
    s = torch.quantile(flat.abs(), ratio, dim=1).clamp(min=1, max=max_value).unsqueeze(1)
    flat = torch.clamp(flat, -s, s) / s
    return flat.reshape(x0.shape).to(dtype)
