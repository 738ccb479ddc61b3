"""A request's control images prepared once (at its first step), and a step's per-row ControlNet outputs.

Each ControlNet in use at a step runs once, on the rows that use it at this step (a control outside its window
weighs 0: its rows skip it); its outputs are weighted per row by the row's scale and added up per row in the
request's own order of controls, as diffusers' MultiControlNetModel (FluxMultiControlNetModel) sums them; rows
without a control get zeros. What a ControlNet takes and gives is the family's (pipelines/control_inputs.py): the
adapter's `control_image` and `control_forward`.

Guess mode (diffusers' `guess_mode`): a request's unconditional row runs no ControlNet and gets zeros
(`unconditional`), and its conditional row's outputs are weighted per block by the family's `guess_scales` times
its scale. Rows in guess mode and rows not share each ControlNet's one forward. A ControlNet that pools its
conditions (`global_pool_conditions`) gives one value per channel; it is added to the other rows' outputs as the
denoiser adds it to its features (broadcast over the grid).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import ControlNetError
from .spec import Control, different_depths


@dataclass
class Prepared:
    """A control ready for the steps: what the request asked, and its image as the ControlNet takes it."""

    control: Control
    image: Tensor  # (1, ...): SD/SDXL pixels in [0, 1], SD3 latents, Flux/Qwen-Image packed latents; pipeline dtype
    uncond_image: Tensor | None = None  # the unconditional row's, where the family prepares its own (SD3 samples it)


def prepare(pipeline, params, generator=None) -> list[Prepared]:
    """The request's control images as the family's ControlNet pipeline prepares them (`generator`: the request's,
    for a family that samples the control image's latents; a family may draw from another: `control_generator`).
    A family's `control_image` gives a pair (conditional, unconditional row's) where the rows' images differ."""
    generator = getattr(pipeline, "control_generator", lambda _, g: g)(params, generator)
    out = []
    for c in params.controls:
        image = pipeline.control_image(c.image, params, generator)
        out.append(Prepared(c, *image) if isinstance(image, tuple) else Prepared(c, image))
    return out


def unconditional(prepared: list[Prepared] | None) -> list[Prepared] | None:
    """A request's controls as its unconditional row takes them: none in guess mode (diffusers adds zeros to that
    row), else the unconditional row's own image where the family prepares one (SD3 samples it)."""
    if not prepared or prepared[0].control.guess_mode:
        return None if prepared else prepared
    if all(p.uncond_image is None for p in prepared):
        return prepared
    return [Prepared(p.control, p.uncond_image) if p.uncond_image is not None else p for p in prepared]


def _flatten(out: dict) -> tuple[list, list[Tensor]]:
    """{keyword: tensor or tuple of tensors} -> (its structure, the tensors in order)."""
    shape, flat = [], []
    for key, value in out.items():
        many = isinstance(value, (tuple, list))
        shape.append((key, len(value) if many else None))
        flat.extend(value if many else [value])
    return shape, flat


def _unflatten(shape: list, flat: list[Tensor]) -> dict:
    """The keywords again; one of no outputs is left out (a Flux ControlNet without single-stream blocks: the
    transformer takes None there, and an empty tuple would divide by zero)."""
    out, at = {}, 0
    for key, n in shape:
        if n != 0:
            out[key] = tuple(flat[at:at + n]) if n is not None else flat[at]
        at += 1 if n is None else n
    return out


# How diffusers' transformers spread the outputs of one ControlNet over their blocks, per keyword: (the blocks that
# take them, block k's output index of `n` over `blocks`). Flux.1 and Qwen-Image: k // ceil(blocks / n); SD3:
# int(k / (blocks / n)).
SPREAD = {
    "controlnet_block_samples": ("transformer_blocks", lambda k, blocks, n: k // math.ceil(blocks / n)),
    "controlnet_single_block_samples": ("single_transformer_blocks", lambda k, blocks, n: k // math.ceil(blocks / n)),
    "block_controlnet_hidden_states": ("transformer_blocks", lambda k, blocks, n: int(k / (blocks / n))),
}


def _one_depth_per_row(order: list[list[str]], shapes: dict) -> None:
    """A request's ControlNets are summed output by output (diffusers' Multi models): of different depths they
    cannot be (a request naming such is refused before it is queued: serving.check_depths)."""
    for names in order:
        mine = [n for n in dict.fromkeys(names) if n in shapes]
        if any(shapes[n] != shapes[mine[0]] for n in mine):
            raise ControlNetError(different_depths(mine, {n: shapes[n] for n in mine}))


def _spread(pipeline, shapes: dict, outputs: dict) -> tuple[list, dict]:
    """Rows whose ControlNets have different depths (each row's of one depth) share the forward: each ControlNet's
    outputs are spread over the denoiser's blocks as the denoiser spreads a lone ControlNet's (SPREAD), so every
    block gets its own entry, and a row gets exactly what it gets alone. Returns the keywords' structure and
    `outputs` with each ControlNet's list laid out on it (None where it adds nothing: no single-stream blocks)."""
    keys = list(dict.fromkeys(key for shape in shapes.values() for key, n in shape if n))
    denoiser = getattr(getattr(pipeline, "networks", None), "transformer", None)
    if denoiser is None or any(key not in SPREAD for key in keys):  # a UNet's are checked to match it at load
        raise ControlNetError(different_depths(shapes, shapes, "one forward of this model"))
    target = [(key, len(getattr(denoiser, SPREAD[key][0]))) for key in keys]
    laid = {}
    for name, entries in outputs.items():
        offsets, at = {}, 0
        for key, n in shapes[name]:
            offsets[key] = (at, n or 0)
            at += 1 if n is None else n
        picks = []
        for key, blocks in target:
            start, n = offsets.get(key, (0, 0))
            picks += [start + SPREAD[key][1](k, blocks, n) if n else None for k in range(blocks)]
        laid[name] = [(where, [None if j is None else res[j] for j in picks]) for where, res in entries]
    return target, laid


def residuals(store, pipeline, sample: Tensor, timesteps: Tensor, conditioning: dict, rows: list,
              shallow: list[bool] | None = None) -> dict:
    """The denoiser's control keywords for the step's rows. `conditioning`: the rows' collated conditioning;
    `rows[i]`: (the Prepared controls of row i's request, its step, its number of steps). Empty when no row has a
    control weighing anything at this step. `shallow[i]`: row i reuses the denoiser's deep part at this step (step
    caching), so its ControlNets run only as far as the outputs its shallow part takes (the family's
    `control_forward_shallow`); when no row needs the rest, the keywords hold only those first outputs."""
    uses: dict[tuple[str, bool], list[tuple[int, float, Tensor, bool]]] = {}  # (name, shallow) -> rows using it
    order: list[list[str]] = []  # per row: the ControlNets it uses now, in its request's order
    for i, (prepared, step, steps) in enumerate(rows):
        names = []
        for p in prepared or ():
            weight = p.control.weight(step, steps)
            if weight:
                uses.setdefault((p.control.name, bool(shallow and shallow[i])), []).append(
                    (i, weight, p.image, p.control.guess_mode))
                names.append(p.control.name)
        order.append(names)
    if not uses:
        return {}
    nets = store.ensure(list(dict.fromkeys(name for name, _ in uses)))
    outputs: dict[str, list[tuple[dict[int, int], list[Tensor]]]] = {}  # name -> its forwards' (row -> j, outputs)
    shapes = {}
    for (name, part), used in uses.items():
        at = [i for i, *_ in used]
        index = torch.tensor(at, device=sample.device)
        picked = {k: v.index_select(0, index) for k, v in conditioning.items()}
        forward = pipeline.control_forward_shallow if part else pipeline.control_forward
        out = forward(nets[name], sample.index_select(0, index), timesteps.index_select(0, index), picked,
                      torch.cat([image for _, _, image, _ in used]))
        shape, flat = _flatten(out)
        if not part:
            shapes[name] = shape
        count = pipeline.control_outputs(nets[name]) if part else len(flat)
        outputs.setdefault(name, []).append(({row: j for j, row in enumerate(at)},
                                             _weighted(pipeline, nets[name], flat, used, count)))
    if shapes and any(s != next(iter(shapes.values())) for s in shapes.values()):  # different depths
        _one_depth_per_row(order, shapes)
        shape, outputs = _spread(pipeline, shapes, outputs)
    elif shapes:
        shape = next(iter(shapes.values()))
    else:  # every row using a ControlNet reuses the deep part: only the shallow outputs
        shape = _flatten(out)[0]
    widest = max(len(res) for entries in outputs.values() for _, res in entries)
    total = []
    for b in range(widest):
        present = [res[b] for entries in outputs.values() for _, res in entries if len(res) > b and res[b] is not None]
        grid = torch.broadcast_shapes(*(r.shape[1:] for r in present))
        total.append(torch.zeros((len(rows), *grid), dtype=present[0].dtype, device=present[0].device))
    for slot in range(max(len(names) for names in order)):  # each row adds its controls in its own order
        for name, entries in outputs.items():
            for where, res in entries:
                at = [i for i, names in enumerate(order) if len(names) > slot and names[slot] == name and i in where]
                if not at:
                    continue
                into = torch.tensor(at, device=sample.device)
                take = torch.tensor([where[i] for i in at], device=sample.device)
                for t, r in zip(total, res):  # a shallow forward's rows get its first outputs only
                    if r is not None:
                        t.index_add_(0, into, r.index_select(0, take).expand(len(at), *t.shape[1:]))
    return _unflatten(shape, total)


def _weighted(pipeline, net, flat: list[Tensor], used: list, count: int) -> list[Tensor]:
    """A ControlNet's outputs for its rows (its first ones of `count`), each row's weighted by its scale (times the
    family's guess-mode scale of each output for a row in guess mode). The table stays float32 and each product
    is rounded to the outputs' dtype once, as diffusers multiplies by the Python float: a table in bfloat16 would
    round 0.7 to 0.6992 before the product."""
    guess = any(g for *_, g in used)
    factors = pipeline.guess_scales(net, count)[:len(flat)] if guess else [1.0]
    table = torch.tensor([[float(w * f) if g else w for _, w, _, g in used] for f in factors],
                         dtype=torch.float32, device=flat[0].device)  # one copy to the device
    return [(r * table[b if guess else 0].view(-1, *[1] * (r.dim() - 1))).to(r.dtype) for b, r in enumerate(flat)]


def sources(n: int, guided: list[int], mine: range, from_conditional: bool) -> tuple[list[int], list[int]]:
    """Which of a step's rows run the ControlNets for the rows `mine` (a CFG half, or all of them): (the rows to
    run them on, then for each row of `mine` the index of its outputs among those), the step's rows being the `n`
    conditional rows, then the unconditional row of each request in `guided`. A family whose pipeline runs them
    on the prompt only (`from_conditional`: Qwen-Image) runs them on the conditional row of each of `mine`, which
    its unconditional row shares."""
    wanted = [i if i < n or not from_conditional else guided[i - n] for i in mine]
    run = list(dict.fromkeys(wanted))
    return run, [run.index(i) for i in wanted]


def select_rows(out: dict, rows: list[int]) -> dict:
    """Control keywords for the rows `rows` of those in `out` (an unconditional row taking its conditional row's)."""
    if not out:
        return out
    first = next(iter(out.values()))
    at = torch.tensor(rows, device=(first[0] if isinstance(first, tuple) else first).device)
    return {k: tuple(t.index_select(0, at) for t in v) if isinstance(v, tuple) else v.index_select(0, at)
            for k, v in out.items()}
