"""A request's pictures, the one decoder for all of them: an edit's image and mask (multipart files), control images
and image prompts (form files, or base64 in a JSON body).

Each picture is bounded twice before its pixels are read: its bytes (an edit's MAX_FILE_BYTES, base64 counted before
it is decoded) and its sides, read from the header (open_picture: a small file can decode to gigabytes). Its
pixels are then decoded and converted once to what the engine takes (request/validation.as_image: 16-bit grayscale
scaled to 8 bits, not clipped white), in a worker thread, never on the event loop. Anything wrong is a 400 naming
the field.
"""

from __future__ import annotations

import base64
import binascii
import io

from ..request.types import ModelInfo
from ..request.validation import as_image
from .errors import invalid
from .forms import MAX_FILE_BYTES  # one picture: an uploaded file, or a JSON body's base64 picture once decoded

FORMATS = ("PNG", "JPEG", "WEBP")
# The widest or tallest picture read: a phone photo (4032x3024) fits, decoded in about 50 MB; `size` then resizes it
# to what the model makes. A model that makes larger images takes pictures as large as it makes.
MAX_PICTURE_SIDE = 4096


def picture_side(model: ModelInfo) -> int:
    """The widest or tallest picture a request may send: MAX_PICTURE_SIDE, or the model's largest size."""
    return max(MAX_PICTURE_SIDE, model.max_size)


def open_picture(data: bytes, field: str, model: ModelInfo):
    """The picture, opened lazily (its header read, its pixels not), and refused when it is larger than the server
    reads (picture_side)."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except Image.DecompressionBombError:
        raise invalid(f"{field}: more than {Image.MAX_IMAGE_PIXELS} pixels (Pillow's decompression-bomb limit)",
                      field) from None
    except Exception:  # noqa: BLE001 - Pillow raises many kinds for data it cannot read
        raise invalid(f"{field}: not a PNG, JPEG or WebP image ({len(data)} bytes)", field) from None
    side = picture_side(model)
    if image.width > side or image.height > side:
        raise invalid(f"{field}: {image.width}x{image.height} (width x height) is larger than this server reads; "
                      f"allowed: width and height at most {side} (resize the picture first; `size` then picks what "
                      f"{model.name} makes, at most {model.max_size})", field)
    return image


def from_base64(text: str, field: str) -> bytes:
    """A base64 picture (or a data: URL of one), refused before decoding when larger than an edit's picture."""
    if text.startswith("data:"):
        text = text.partition(",")[2]
    if len(text) > (MAX_FILE_BYTES + 2) // 3 * 4:
        raise invalid(f"{field}: larger than {MAX_FILE_BYTES // 2**20} MiB (as an edit's image)", field)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"{field}: not base64 (a PNG, JPEG or WebP file encoded as base64, or a data: URL)",
                      field) from None


def decode(picture, field: str, mode: str = "RGB"):
    """An opened picture's pixels, decoded and in `mode` (a worker thread's work: it is the costly part)."""
    try:
        picture.load()
    except Exception:  # noqa: BLE001 - a header that reads but pixels that do not (a truncated file)
        raise invalid(f"{field}: not a readable PNG, JPEG or WebP image (its pixels could not be decoded)",
                      field) from None
    return as_image(field, picture, mode)


def sent_picture(field: str, value, model: ModelInfo):
    """A picture of a JSON body (base64 text) opened, checked and decoded as RGB. A worker thread's work."""
    if not isinstance(value, str):
        raise invalid(f"{field}: expected a base64 PNG, JPEG or WebP image (or a data: URL of one), got "
                      f"{type(value).__name__}", field)
    return decode(open_picture(from_base64(value, field), field, model), field)
