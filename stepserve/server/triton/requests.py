"""The entry model's tensors <-> stepserve's SamplingParams and images, with no Triton import.

A request carries one image per batch row; every input is one element per row. Missing optional inputs take the
model's defaults. Errors name the Triton input (not stepserve's field) and what is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from stepserve.request.types import ModelInfo, SamplingParams
from stepserve.request.validation import ValidationError, resolve_params

# Triton input -> SamplingParams field, and how one element is read
_FIELDS = {
    "prompt": ("prompt", "text"),
    "negative_prompt": ("negative_prompt", "text"),
    "seed": ("seed", "int"),
    "steps": ("num_inference_steps", "int"),
    "guidance_scale": ("guidance_scale", "float"),
    "sampler": ("sampler", "text"),
    "height": ("height", "int"),
    "width": ("width", "int"),
    "timeout_s": ("timeout_s", "float"),  # optional deadline in seconds from arrival; past it the request fails
    "cache": ("cache", "cache"),  # optional step caching: a policy name, "off", or a JSON object with knobs
    "loras": ("loras", "json"),  # optional LoRA adapters: a JSON list of {"name": ..., "scale": ...}
}
INPUT_NAMES = tuple(_FIELDS)  # the entry model's inputs, in config order
_TRITON_NAME = {field: name for name, (field, _) in _FIELDS.items()}
REQUIRED = ("prompt", "seed", "steps", "guidance_scale")
QUEUE_FULL_PREFIX = "queue full"  # clients map an error starting with this to a refusal (retry later)


class BadRequest(ValueError):
    """A request the model refuses; the message names the input and what is allowed."""


@dataclass(frozen=True)
class ParsedRequest:
    params: list[SamplingParams]  # one per batch row, resolved (defaults filled in)


def _element(name: str, kind: str, value):
    if kind == "text":
        if isinstance(value, (bytes, np.bytes_)):
            try:
                return bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(f"{name}: must be UTF-8 text") from None
        if isinstance(value, str):
            return value
        raise BadRequest(f"{name}: must be a string (TYPE_STRING / BYTES), got {type(value).__name__}")
    if kind == "json":
        text = _element(name, "text", value)
        try:
            return json.loads(text)
        except ValueError:
            raise BadRequest(f"{name}: not JSON: {text[:60]!r}") from None
    if kind == "cache":
        text = _element(name, "text", value)
        if not text.lstrip().startswith("{"):
            return text
        try:
            return json.loads(text)
        except ValueError:
            raise BadRequest(f"{name}: not a JSON object: {text[:60]!r}") from None
    if kind == "int":
        if not np.issubdtype(np.asarray(value).dtype, np.integer):
            raise BadRequest(f"{name}: must be an integer, got {value!r}")
        return int(value)
    return float(value)


def request_inputs(request, get_input) -> dict[str, np.ndarray | None]:
    """Every entry-model input of one Triton request as numpy, None where the client left it out. `get_input` is
    the Python backend's `pb_utils.get_input_tensor_by_name` (passed in, so this module imports without Triton)."""
    inputs = {}
    for name in INPUT_NAMES:
        tensor = get_input(request, name)
        inputs[name] = None if tensor is None else tensor.as_numpy()
    return inputs


def parse_request(inputs: dict[str, np.ndarray | None], model: ModelInfo) -> ParsedRequest:
    """SamplingParams for every row of one request (`inputs`: Triton input name -> array, None when absent)."""
    missing = [n for n in REQUIRED if inputs.get(n) is None]
    if missing:
        raise BadRequest(f"{', '.join(missing)}: required input(s) missing; the model takes prompt, seed, steps, "
                         f"guidance_scale and optionally negative_prompt, sampler, height, width, timeout_s, cache, loras")
    rows = {name: np.asarray(a).reshape(len(a) if np.ndim(a) else 1, -1) for name, a in inputs.items()
            if a is not None and name in _FIELDS}
    counts = {name: a.shape for name, a in rows.items()}
    batch = rows["prompt"].shape[0]
    bad = [f"{n} {s}" for n, s in counts.items() if s != (batch, 1)]
    if bad:
        raise BadRequest(f"every input must hold one element per batch row (shape [{batch}, 1]); got "
                         + ", ".join(bad))
    params = []
    for i in range(batch):
        values = {field: _element(name, kind, rows[name][i, 0]) for name, (field, kind) in _FIELDS.items()
                  if name in rows}
        try:
            params.append(resolve_params(SamplingParams(**values), model))
        except ValidationError as e:
            name = _TRITON_NAME.get(e.field, e.field)
            raise BadRequest(f"{name}: {str(e).split(': ', 1)[1]}") from None
    return ParsedRequest(params)


def image_array(image) -> np.ndarray:
    """A PIL image as uint8 (H, W, C): C = 1 for greyscale, 3 for colour. Other modes are converted first: a
    palette image (the fake model's) to its RGB colours, not its indices; a 1-bit one to 0/255 greyscale; alpha
    is dropped."""
    if image.mode not in ("L", "RGB"):
        image = image.convert("L" if image.mode in ("1", "LA", "I", "F") else "RGB")
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels[..., None] if pixels.ndim == 2 else pixels


def stack_images(images: list) -> np.ndarray:
    """The `image` output of one request: (rows, H, W, C). Rows of one request must share a size."""
    arrays = [image_array(im) for im in images]
    if len({a.shape for a in arrays}) > 1:
        raise BadRequest("the rows of one request must ask for one image size; send different sizes as separate "
                         "requests")
    return np.stack(arrays)
