"""`POST /v1/images/edits`: OpenAI's image-edit request (multipart/form-data: `image`, `prompt`, optional `mask`,
`n`, `size`, `response_format`, ...) plus stepserve's own fields, as one image-to-image request per image.

The form is read within the server's upload limits (forms.py). Form fields arrive as text; each is read as its
JSON type (`n=2`, `guidance_scale=3.5`, `stream=true`, `cache` and `loras` as JSON) and then checked exactly as the
generations body is (ImageGenerationRequest), with `strength` (default: the model's) on top. The image and the
mask: PNG, JPEG or WebP, at most MAX_FILE_BYTES each, checked and decoded as every picture of a request is
(pictures.py: the sides read from the header first, the pixels in a worker thread). Anything else is a 400 naming
the field. A `mask` makes the request an inpainting one. As OpenAI defines it, a mask with an alpha
channel repaints where it is transparent; a mask without one repaints where it is white (diffusers' convention);
either way it must have the image's size. ControlNets and an image prompt come as form parts (edit_controls.py),
their pictures with the image's limits.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from fastapi import Request
from starlette.datastructures import UploadFile

from ..controls.spec import MAX_PER_REQUEST
from ..request.validation import as_image
from .controlnets import resolved_addons
from .edit_controls import control_parts, image_prompt_parts
from .errors import APIError, invalid
from .forms import MAX_FILE_BYTES, bounded_form, form_fields
from .pictures import decode, open_picture
from .schemas import FIELDS, body_from_fields, engine_params
from .state import ServerState

_FILES = ("image", "image[]", "mask")
_TEXT = {"prompt", "model", "size", "response_format", "user", "output_format", "background", "quality", "style",
         "moderation", "sampler", "negative_prompt", "safety_identifier", "webhook"}  # fields taken as text, never parsed


@dataclass
class EditForm:
    """An edit request as sent: its text fields (parsed) and its pictures' bytes (what an edit job keeps to run it
    again)."""

    fields: dict
    image: bytes
    mask: bytes | None = None
    controls: list[bytes] = field(default_factory=list)  # the control images (edit_controls.py), in order
    ip_adapter: bytes | None = None  # the image prompt's picture (edit_controls.py)

    def pictures(self) -> dict[str, bytes]:
        """Its pictures by role (what an edit job keeps): image, mask, control0, control1, ..., ip_adapter."""
        return {"image": self.image, **({"mask": self.mask} if self.mask else {}),
                **{f"control{i}": data for i, data in enumerate(self.controls)},
                **({"ip_adapter": self.ip_adapter} if self.ip_adapter else {})}

    @classmethod
    def from_pictures(cls, fields: dict, pictures: dict[str, bytes]) -> "EditForm":
        controls = [pictures[f"control{i}"] for i in range(len(fields.get("controls") or ()))]
        return cls(fields, pictures["image"], pictures.get("mask"), controls, pictures.get("ip_adapter"))


async def read_edit(request: Request, state: ServerState):
    """(the body as an ImageGenerationRequest, one SamplingParams per image with the image and strength, the form
    as sent)."""
    async with bounded_form(request, state, max_files=5 + MAX_PER_REQUEST) as form:
        images = [v for k, v in form.multi_items() if k in ("image", "image[]")]
        if not images or not isinstance(images[0], UploadFile):
            raise invalid("image: required, an image file (PNG, JPEG or WebP)", "image")
        if len(images) > 1:
            raise invalid(f"image: {len(images)} images given; one image per edit request is served", "image")
        mask = form.get("mask")
        if mask is not None and not isinstance(mask, UploadFile):
            raise invalid("mask: an image file (PNG, JPEG or WebP) is expected", "mask")
        controls, files, taken = control_parts(form)  # controls[i][name], controls[i][image], ... (edit_controls.py)
        prompt, prompt_file, prompt_taken = image_prompt_parts(form)  # ip_adapter[name], ip_adapter[image], ...
        fields = form_fields(form, _TEXT, (*_FILES, "input_fidelity", *taken, *prompt_taken),
                             "image, mask, controls[i][image], ip_adapter[image]")
        # (input_fidelity: an OpenAI field accepted and ignored, as quality and style are)
        if controls:
            fields["controls"] = controls
        if prompt is not None:
            fields["ip_adapter"] = prompt
        sent = EditForm(fields, await _read(images[0], "image"), None if mask is None else await _read(mask, "mask"),
                        [await _read(f, f"controls[{i}][image]") for i, f in enumerate(files)],
                        None if prompt_file is None else await _read(prompt_file, "ip_adapter[image]"))
    req, params = await edit_params(sent, state)
    return req, params, sent


async def edit_params(sent: EditForm, state: ServerState):
    """(the body as an ImageGenerationRequest, one SamplingParams per image with the image and strength): the
    pictures' headers checked, then the fields, then the pictures decoded and the add-ons resolved, once for the
    request, off the event loop (pictures.py, controlnets.resolved_addons)."""
    model = state.engine.model_info
    image = open_picture(sent.image, "image", model)
    mask = None if sent.mask is None else open_picture(sent.mask, "mask", model)
    named = [(f"controls[{i}][image]", data) for i, data in enumerate(sent.controls)]
    named += [("ip_adapter[image]", sent.ip_adapter)] if sent.ip_adapter is not None else []
    named = [(name, open_picture(data, name, model)) for name, data in named]
    fields = dict(sent.fields)
    controls = fields.pop("controls", None) or []  # each without its image, which is in `named`
    prompt = fields.pop("ip_adapter", None)  # without its image: the last of `named`
    strength = fields.pop("strength", None)
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise invalid(f"{unknown[0]}: not a field of an edit; allowed: image, mask, strength, "
                      f"{', '.join(FIELDS)}", unknown[0])
    req = body_from_fields(fields, state.limits)  # the cheap checks before any decoding
    image, mask, pictures = await asyncio.to_thread(_decode, image, mask, named)
    prompt = None if prompt is None else {**prompt, "image": pictures.pop()}
    controls = [{**c, "image": picture} for c, picture in zip(controls, pictures)] or None
    params = [replace(p, image=image, strength=strength, mask_image=mask, controls=controls, ip_adapter=prompt)
              for p in engine_params(req, state.limits)]
    return req, await resolved_addons(params, lambda field, picture: picture, state)


async def _read(upload: UploadFile, name: str) -> bytes:
    data = await upload.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise APIError(413, f"{name}: larger than {MAX_FILE_BYTES // 2**20} MiB", code="body_too_large", param=name)
    return data


def _decode(image, mask, named=()):
    """(the image as RGB, the mask as the grayscale that repaints where white, or None, the other pictures as RGB:
    `named`, (form part, picture) each): the pixels decoded and converted once, in a worker thread."""
    image = decode(image, "image")
    mask = None if mask is None else repaint_mask(decode(mask, "mask", mask.mode))
    return image, mask, [decode(picture, name) for name, picture in named]


def repaint_mask(mask):
    """A grayscale mask that is white where the request repaints: from the alpha channel when the mask has one
    (OpenAI's rule: transparent areas are edited), else the mask's own gray levels (diffusers' rule)."""
    from PIL import ImageOps

    if mask.mode in ("RGBA", "LA", "PA") or (mask.mode == "P" and "transparency" in mask.info):
        return ImageOps.invert(as_image("mask", mask, "RGBA").getchannel("A"))
    return as_image("mask", mask, "L")

