"""`POST /v1/images/edits`: OpenAI's image-edit request (multipart/form-data: `image`, `prompt`, optional `mask`,
`n`, `size`, `response_format`, ...) plus stepserve's own fields, as one image-to-image request per image.

Form fields arrive as text; each is read as its JSON type (`n=2`, `guidance_scale=3.5`, `stream=true`, `cache` and
`loras` as JSON) and then checked exactly as the generations body is (ImageGenerationRequest), with `strength`
(default: the model's) on top. The image and the mask: PNG, JPEG or WebP, at most MAX_IMAGE_BYTES each, and no
more pixels than Pillow's decompression-bomb limit; anything else is a 400 naming the field. A `mask` makes the
request an inpainting one. As OpenAI defines it, a mask with an alpha channel repaints where it is transparent;
a mask without one repaints where it is white (diffusers' convention); either way it must have the image's size.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace

from fastapi import Request
from starlette.datastructures import UploadFile

from .errors import APIError, invalid
from .schemas import FIELDS, ServerLimits, engine_params, parse_body

MAX_IMAGE_BYTES = 16 * 2**20
FORMATS = ("PNG", "JPEG", "WEBP")
_TEXT = {"prompt", "model", "size", "response_format", "user", "output_format", "background", "quality", "style",
         "moderation", "sampler", "negative_prompt", "safety_identifier"}  # fields taken as text, never parsed


async def read_edit(request: Request, limits: ServerLimits):
    """(the body as an ImageGenerationRequest, one SamplingParams per image with the image and strength)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "multipart/form-data":
        raise APIError(415, f"an edit is sent as multipart/form-data (an image file and form fields), got "
                            f"{kind or 'no content type'!r}", code="unsupported_media_type")
    try:
        form = await request.form(max_files=4, max_fields=64, max_part_size=MAX_IMAGE_BYTES)
    except Exception as exc:  # noqa: BLE001 - the multipart parser's own errors: a malformed or oversized body
        raise invalid(f"the form could not be read: {exc}") from None
    try:
        images = [v for k, v in form.multi_items() if k in ("image", "image[]")]
        if not images or not isinstance(images[0], UploadFile):
            raise invalid("image: required, an image file (PNG, JPEG or WebP)", "image")
        if len(images) > 1:
            raise invalid(f"image: {len(images)} images given; one image per edit request is served", "image")
        mask = form.get("mask")
        if mask is not None and not isinstance(mask, UploadFile):
            raise invalid("mask: an image file (PNG, JPEG or WebP) is expected", "mask")
        fields, strength = _fields(form)
        image = (await _image(images[0], "image")).convert("RGB")
        mask = None if mask is None else repaint_mask(await _image(mask, "mask"))
    finally:
        await form.close()
    req = parse_body(json.dumps(fields).encode(), limits)
    params = [replace(p, image=image, strength=strength, mask_image=mask) for p in engine_params(req, limits)]
    return req, params


def _fields(form) -> tuple[dict, object]:
    fields, strength = {}, None
    for key, value in form.multi_items():
        if key in ("image", "image[]", "mask", "input_fidelity") or isinstance(value, UploadFile):
            continue  # (input_fidelity: an OpenAI field accepted and ignored, as quality and style are)
        if key in _TEXT:
            fields[key] = value
            continue
        try:
            parsed = json.loads(value)
        except ValueError:
            raise invalid(f"{key}: {value[:40]!r} is not a JSON value (numbers, true/false, or JSON for cache and "
                          f"loras)", key) from None
        if key == "strength":
            strength = parsed
        else:
            fields[key] = parsed
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise invalid(f"{unknown[0]}: not a field of an edit; allowed: image, mask, strength, "
                      f"{', '.join(FIELDS)}", unknown[0])
    return fields, strength


async def _image(upload: UploadFile, name: str):
    from PIL import Image

    data = await upload.read(MAX_IMAGE_BYTES + 1)
    if len(data) > MAX_IMAGE_BYTES:
        raise APIError(413, f"{name}: larger than {MAX_IMAGE_BYTES // 2**20} MiB", code="body_too_large",
                       param=name)
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))
        image.load()
    except Image.DecompressionBombError:
        raise invalid(f"{name}: more than {Image.MAX_IMAGE_PIXELS} pixels (Pillow's decompression-bomb limit)",
                      name) from None
    except Exception:  # noqa: BLE001 - Pillow raises many kinds for data it cannot read
        raise invalid(f"{name}: not a PNG, JPEG or WebP image ({len(data)} bytes)", name) from None
    return image


def repaint_mask(mask):
    """A grayscale mask that is white where the request repaints: from the alpha channel when the mask has one
    (OpenAI's rule: transparent areas are edited), else the mask's own gray levels (diffusers' rule)."""
    from PIL import ImageOps

    if mask.mode in ("RGBA", "LA", "PA") or (mask.mode == "P" and "transparency" in mask.info):
        return ImageOps.invert(mask.convert("RGBA").getchannel("A"))
    return mask.convert("L")
