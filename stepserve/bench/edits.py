"""Edits in bench workloads: the image pool a trace's edit requests start from, and how an edit request is sent.

A request spec with `edit` set ("image": image to image; "inpaint": with a mask) names an image of the pool by
index. The pool is synthetic and seeded (nothing is read from disk or downloaded): image i at a size is always
the same pixels, and its mask a rectangle covering a quarter to a half of it, so every contender gets identical
edits. Sizes are the request's own (an edit mix must give `size`).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

EDIT_KINDS = ("image", "inpaint")  # a spec's `edit`; None: a generation
POOL_SIZE = 16  # images in the pool; a mix draws an edit's image among them
KINDS = ("generation", *EDIT_KINDS, "controlled", "image prompt")  # how results are split by kind


def kind_of(spec) -> str:
    if spec.edit:
        return spec.edit
    if getattr(spec, "control", None):
        return "controlled"
    return "image prompt" if getattr(spec, "ip_adapter", None) else "generation"


def pool_image(index: int, width: int, height: int) -> Image.Image:
    """Image `index` of the pool: a smooth two-colour gradient with a few blocks and a little noise."""
    rng = np.random.default_rng(index)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    a, b = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    t = (np.cos(rng.uniform(0, np.pi)) * x + np.sin(rng.uniform(0, np.pi)) * y)[..., None]
    pixels = a * (1 - t) + b * t
    for _ in range(3):
        h, w = rng.integers(1, max(2, height // 2)), rng.integers(1, max(2, width // 2))
        top, left = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
        pixels[top : top + h, left : left + w] = rng.uniform(0, 255, 3)
    pixels += rng.normal(0, 8, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def pool_mask(index: int, width: int, height: int) -> Image.Image:
    """The mask of pool image `index`: white (repaint) on a rectangle covering 1/4 to 1/2 of the image."""
    rng = np.random.default_rng(10_000 + index)
    mask = np.zeros((height, width), dtype=np.uint8)
    h = int(height * rng.uniform(0.5, 0.71))
    w = int(width * rng.uniform(0.5, 0.71))
    top, left = rng.integers(0, height - h + 1), rng.integers(0, width - w + 1)
    mask[top : top + h, left : left + w] = 255
    return Image.fromarray(mask, mode="L")


def control_fields(spec, encoded: bool = False) -> list[dict[str, Any]]:
    """The `controls` of a spec with a ControlNet: its map is pool image `spec.image` at the spec's size (a PNG in
    base64 when `encoded`, for the HTTP body)."""
    return [{"name": spec.control, "image": _pooled(spec, spec.image, "a controlled request", encoded)}]


def image_prompt_field(spec, encoded: bool = False) -> dict[str, Any]:
    """The `ip_adapter` of a spec with an image prompt: its picture is pool image `spec.ip_image` at the spec's size
    (a PNG in base64 when `encoded`)."""
    return {"name": spec.ip_adapter, "image": _pooled(spec, spec.ip_image, "a request with an image prompt", encoded)}


def _pooled(spec, index: int | None, what: str, encoded: bool):
    if spec.width is None or spec.height is None:
        raise ValueError(f"{what} needs its size (width and height): the pool draws its pictures at it")
    image = pool_image(index or 0, spec.width, spec.height)
    if encoded:
        import base64

        image = base64.b64encode(_png(image)).decode("ascii")
    return image


def edit_images(spec) -> tuple[Image.Image, Image.Image | None]:
    """(the spec's image, its mask or None)."""
    if spec.width is None or spec.height is None:
        raise ValueError("an edit request needs its size (width and height): the pool draws images at it")
    image = pool_image(spec.image or 0, spec.width, spec.height)
    mask = pool_mask(spec.image or 0, spec.width, spec.height) if spec.edit == "inpaint" else None
    return image, mask


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def edit_form(spec) -> tuple[dict[str, str], dict[str, bytes]]:
    """(form fields, files) of POST /v1/images/edits for an edit spec: its JSON body's fields as text."""
    import json

    image, mask = edit_images(spec)
    fields: dict[str, Any] = spec.to_http()
    if spec.strength is not None:
        fields["strength"] = spec.strength
    text = {k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}
    files = {"image": _png(image)}
    if mask is not None:
        files["mask"] = _png(mask)
    return text, files
