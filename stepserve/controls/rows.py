"""A request's control images prepared once (at its first step), and a step's per-row ControlNet residuals.

Each ControlNet in use at a step runs once, on the rows that use it at this step (a control outside its window
weighs 0: its rows skip it); its residuals are weighted per row by the row's scale and added up per row in the
request's own order of controls, as diffusers' MultiControlNetModel sums them; rows without a control get zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .spec import Control


@dataclass
class Prepared:
    """A control ready for the steps: what the request asked, and its image as the ControlNet takes it."""

    control: Control
    pixels: Tensor  # (1, 3, H, W) in [0, 1], at the request's size, on the device in the pipeline's dtype


def prepare(pipeline, params) -> list[Prepared]:
    """The request's control images as StableDiffusionControlNetPipeline.prepare_image makes them: resized to the
    request's size, RGB, [0, 1] floats (no normalisation)."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=pipeline.vae_scale_factor, do_convert_rgb=True,
                                  do_normalize=False)
    return [Prepared(c, processor.preprocess(c.image, height=params.height, width=params.width)
                     .to(dtype=torch.float32).to(pipeline.device, pipeline.dtype)) for c in params.controls]


def residuals(store, sample: Tensor, timesteps: Tensor, hidden: Tensor, rows: list) -> dict[str, object]:
    """The UNet's control keywords for the step's rows. `rows[i]`: (the Prepared controls of row i's request,
    its step, its number of steps). Empty when no row has a control weighing anything at this step."""
    uses: dict[str, list[tuple[int, float, Tensor]]] = {}  # name -> (row, weight, image) of the rows using it
    order: list[list[str]] = []  # per row: the ControlNets it uses now, in its request's order
    for i, (prepared, step, steps) in enumerate(rows):
        names = []
        for p in prepared or ():
            weight = p.control.weight(step, steps)
            if weight:
                uses.setdefault(p.control.name, []).append((i, weight, p.pixels))
                names.append(p.control.name)
        order.append(names)
    if not uses:
        return {}
    nets = store.ensure(list(uses))
    outputs: dict[str, tuple[dict[int, int], list[Tensor]]] = {}
    for name, used in uses.items():
        at = [i for i, _, _ in used]
        index = torch.tensor(at, device=sample.device)
        down, mid = nets[name](
            sample.index_select(0, index), timesteps.index_select(0, index), hidden.index_select(0, index),
            controlnet_cond=torch.cat([pixels for _, _, pixels in used]), conditioning_scale=1.0, return_dict=False)
        weight = torch.tensor([w for _, w, _ in used], dtype=mid.dtype, device=mid.device).view(-1, 1, 1, 1)
        outputs[name] = ({row: j for j, row in enumerate(at)}, [r * weight for r in (*down, mid)])
    parts = next(iter(outputs.values()))[1]
    total = [torch.zeros((len(rows), *p.shape[1:]), dtype=p.dtype, device=p.device) for p in parts]
    for slot in range(max(len(names) for names in order)):  # each row adds its controls in its own order
        for name, (where, res) in outputs.items():
            at = [i for i, names in enumerate(order) if len(names) > slot and names[slot] == name]
            if not at:
                continue
            into = torch.tensor(at, device=sample.device)
            take = torch.tensor([where[i] for i in at], device=sample.device)
            for t, r in zip(total, res):
                t.index_add_(0, into, r.index_select(0, take))
    return {"down_block_additional_residuals": tuple(total[:-1]), "mid_block_additional_residual": total[-1]}
