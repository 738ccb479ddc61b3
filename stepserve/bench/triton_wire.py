"""What crosses the wire to a Triton model (KServe v2): its inputs as the model's config names them, one request's
tensors, the image it answers, and a Triton error as the load generator counts it (bench/triton_target.py)."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any

from .targets import FAILED, REJECTED, TIMEOUT, Reply
from .workload import RequestSpec

QUEUE_FULL = "queue_full"
QUEUE_FULL_MESSAGES = ("queue full", "exceeds maximum queue size")  # stepserve's model; Triton's dynamic batcher
_REQUEST_ID = re.compile(r"^\[request id: [^\]]*\]\s*")  # Triton's own errors start with it
# Sent when a request leaves a field to the model's default but the model's config makes that input required:
# the embedded model's serving defaults.
FALLBACK_DEFAULTS = {"steps": 15, "guidance_scale": 3.0}


@dataclass(frozen=True)
class ModelInputs:
    """What the model's config says about its inputs: names, which are optional, and whether it is decoupled."""

    names: frozenset[str]
    optional: frozenset[str]
    decoupled: bool
    max_batch_size: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelInputs:
        inputs = config.get("input", [])
        return cls(frozenset(i["name"] for i in inputs), frozenset(i["name"] for i in inputs if i.get("optional")),
                   bool(config.get("model_transaction_policy", {}).get("decoupled")),
                   int(config.get("max_batch_size", 0)))


def request_tensors(spec: RequestSpec, model: ModelInputs) -> list[tuple[str, str, Any]]:
    """(name, Triton datatype, value) for each input to send: fields left to the model's default are left out when
    the model's input is optional (or absent), else sent as FALLBACK_DEFAULTS."""
    fields = [("prompt", "BYTES", spec.prompt), ("negative_prompt", "BYTES", spec.negative_prompt or None),
              ("seed", "INT64", spec.seed), ("steps", "INT32", spec.num_inference_steps),
              ("guidance_scale", "FP32", spec.guidance_scale), ("sampler", "BYTES", spec.sampler),
              ("height", "INT32", spec.height), ("width", "INT32", spec.width)]
    out = []
    for name, datatype, value in fields:
        if value is None and (name in model.optional or name not in model.names or name not in FALLBACK_DEFAULTS):
            continue
        out.append((name, datatype, FALLBACK_DEFAULTS[name] if value is None else value))
    return out


_NUMPY = {"INT64": "int64", "INT32": "int32", "FP32": "float32"}


def numpy_array(datatype: str, value: Any):
    import numpy as np

    if datatype == "BYTES":
        return np.array([[str(value).encode()]], dtype=object)
    return np.array([[value]], dtype=_NUMPY[datatype])


def raw_bytes(datatype: str, value: Any) -> bytes:
    """One element in KServe v2's raw tensor encoding (BYTES: 4-byte little-endian length, then the bytes)."""
    if datatype == "BYTES":
        data = str(value).encode()
        return struct.pack("<I", len(data)) + data
    return numpy_array(datatype, value).tobytes()


def to_image(array):
    """The model's uint8 (1, H, W, C) (or (H, W, C)) output as a PIL image."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(array, dtype=np.uint8)
    if pixels.ndim == 4:
        pixels = pixels[0]
    if pixels.ndim == 3 and pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    return Image.fromarray(pixels)


def error_reply(message: str, status: str | None = None, timed_out: bool = False) -> Reply:
    """A Triton error as the load generator counts it."""
    text = message or status or "unknown error"
    if timed_out:
        return Reply(TIMEOUT, error=f"deadline exceeded: {text}", reason="deadline_exceeded")
    if _REQUEST_ID.sub("", text.strip()).lower().startswith(QUEUE_FULL_MESSAGES):
        return Reply(REJECTED, error=text, reason=QUEUE_FULL)
    return Reply(FAILED, error=f"[{status}] {text}" if status else text)


def deadline_status(status: str | None) -> bool:
    return status is not None and "DEADLINE_EXCEEDED" in status


def is_final(response) -> bool:
    param = response.parameters.get("triton_final_response")
    return param is not None and param.bool_param
